

def test_a_disagreement_fails_the_test_that_wrote_the_blob(tmp_path):
    """End to end, in a pytest run of its own: the hooks check after each test, fail the one whose
    blob the decoders read differently (here a reference made to flip one bit), pass the others,
    and print the summary line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(tests)!r})\n"
        "import cgen_conformance\n\n\n"
        "def pytest_configure(config):\n"
        "    cgen_conformance.register(config)\n")
    (tmp_path / "test_inner.py").write_text(
        "import torch, types\n"
        "import cachegen_cli as cg\n"
        "import cgen_conformance as conf\n\n\n"
        "def kv():\n"
        "    return torch.linspace(-3, 3, 2 * 2 * 9 * 8).reshape(2, 2, 9, 1, 8).to(torch.bfloat16)\n\n\n"
        "def test_agrees():\n"
        "    cg.encode(kv(), quality='balanced', chunk_tokens=8, device='cpu')\n\n\n"
        "def test_disagrees():\n"
        "    real = conf.RECORDER.reference()\n\n"
        "    def decode(blob, calibration=None):\n"
        "        d = real.decode(blob, calibration)\n"
        "        next(iter(d.tensors.values()))[1].reshape(-1)[3] ^= 1\n"
        "        return d\n\n"
        "    conf.RECORDER._ref = types.SimpleNamespace(decode=decode, FormatViolation=real.FormatViolation)\n"
        "    cg.encode(kv(), quality='small', chunk_tokens=8, device='cpu')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop(conf.ENV, None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed, 1 passed" in r.stdout and "FAILED test_inner.py::test_disagrees" in r.stdout
    assert "kv: 1 of 288 values differ" in r.stdout
    assert "cgen conformance: 1 .cgen blobs decoded identically" in r.stdout and "1 DISAGREED" in r.stdout
