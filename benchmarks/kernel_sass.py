"""SASS of the device pipeline's quantize / dequantize kernels for the H200 (sm_90), made on a
machine without a GPU: numba's NVVM makes the PTX, the ptxas and cuobjdump that Triton ships
make and dump the machine code.  Prints the registers, the instructions of the kernel and
those of each loop body (rare paths included), and writes the SASS next to it for reading.

    python benchmarks/kernel_sass.py quantize --values 4 --bits 16 --fmt 1      # bfloat16 words in
    python benchmarks/kernel_sass.py dequantize --values 4 --out-bytes 2         # bfloat16 values out
    python benchmarks/kernel_sass.py quantize --values 2 --bits 32 --fmt 0 --out /tmp/q.sass

Needs libnvvm and libdevice (CUDA_HOME, default /usr/local/cuda) and Triton's nvidia backend;
nothing runs on a GPU.  Why: the kernels are bound by the instructions they issue (Nsight
Compute, docs/benchmarks.md), so their count per value is what to read between device runs.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))


def _no_gpu_compiler():
    """numba-cuda asks the driver for the device's compute capability and NVRTC for the
    supported ones: answer sm_90 without either."""
    import numba.cuda.cudadrv.libs as libs
    import numba.cuda.cudadrv.nvrtc as nvrtc
    import numba.cuda.cudadrv.nvvm as nvvm
    import numba.cuda.dispatcher as dispatcher

    class _Device:
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Device()
    nvrtc.get_supported_ccs = lambda: ((8, 0), (9, 0))
    libdevice = str(next((CUDA_HOME / "nvvm" / "libdevice").glob("libdevice*.bc")))
    libs.get_libdevice = nvvm.get_libdevice = lambda: libdevice


def _tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _instructions(sass: str) -> list[tuple[int, str]]:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int, int, collections.Counter]]:
    """(start, end, instructions, opcode counts) of each backward branch's body."""
    where = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA\s.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in where:
            body = ins[where[int(m.group(1), 16)]: i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
            found.append((int(m.group(1), 16), a, len(body), ops))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=["quantize", "dequantize"])
    ap.add_argument("--values", type=int, default=4, help="values a thread (V)")
    ap.add_argument("--bits", type=int, default=16, help="quantize: bits of a value word (B)")
    ap.add_argument("--fmt", type=int, default=1, help="quantize: FMT_* of the words (0 float32, 1 bfloat16, ...)")
    ap.add_argument("--lossless", action="store_true", help="quantize: the lossless method's kernel")
    ap.add_argument("--out-bytes", type=int, default=2, help="dequantize: bytes a value out")
    ap.add_argument("--levels", action="store_true", help="dequantize: int16 levels out")
    ap.add_argument("--maxreg", type=int, default=None, help="register cap (default: the pipeline's REG_CAPS)")
    ap.add_argument("--out", type=Path, default=None, help="where to write the SASS (default: a temporary file)")
    args = ap.parse_args()

    _no_gpu_compiler()
    from numba import cuda
    from numba import types as nt

    from cachegen_cli.kernels import cuda_pipeline as k

    def arr(dt, nd):
        return nt.Array(dt, nd, "C")

    i8 = nt.int64
    word = {1: nt.int8, 2: nt.int16, 4: nt.int32, 8: nt.int64}
    if args.kernel == "quantize":
        kern = k._make_quantize(args.values, args.bits, args.lossless, args.fmt)
        sig = (arr(nt.int64, 1), i8, i8, i8, i8, arr(nt.float32, 3), arr(nt.float64, 2), nt.float64, nt.float32, i8,
               i8, i8, i8, arr(word[args.values], 1), arr(nt.uint8, 4), arr(nt.int32, 5), i8, arr(nt.int32, 1))
    else:
        kern = k._make_dequantize(args.values, args.out_bytes, True, args.levels)
        sig = (arr(word[args.values], 1), i8, i8, i8, arr(nt.uint8, 3), arr(nt.int32, 3), i8, i8, arr(nt.float32, 3),
               arr(nt.float64, 2), i8, i8, arr(nt.uint8, 1), arr(nt.int64, 1), i8,
               arr(word[args.values * args.out_bytes], 1), arr(nt.int64, 1))
    fn = kern.dispatcher.py_func if hasattr(kern, "dispatcher") else kern.py_func
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    out = args.out or Path(os.environ.get("TMPDIR", "/tmp")) / f"{args.kernel}.sass"
    ptx_path, cubin = out.with_suffix(".ptx"), out.with_suffix(".cubin")
    ptx_path.write_text(ptx)
    cap = args.maxreg if args.maxreg is not None else k.REG_CAPS.get(args.kernel)
    cmd = [str(_tools() / "ptxas-blackwell"), "-arch=sm_90", "-v", str(ptx_path), "-o", str(cubin)]
    if cap:
        cmd.append(f"-maxrregcount={cap}")
    made = subprocess.run(cmd, capture_output=True, text=True, check=True)
    sass = subprocess.run([str(_tools() / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    out.write_text(sass)
    ins = _instructions(sass)
    print(next((ln.split("info    : ")[-1] for ln in made.stderr.splitlines() if "Used" in ln), "registers: ?"))
    print(f"{len(ins)} instructions; SASS in {out}")
    for start, end, n, ops in loops(ins):
        print(f"loop {start:#06x}-{end:#06x}: {n} instructions:", ", ".join(f"{o} {c}" for o, c in ops.most_common(10)))


if __name__ == "__main__":
    main()
