"""Registers and spills of kernels/fixed_rotation_matmul.py's two kernels, compiled for a GPU
without one (Triton to PTX, then its bundled ptxas -v), for each launch shape asked:

    python benchmarks/rotation_registers.py --arch 90 --configs "64,4,2,64;128,8,2,64"

Each config is rows,warps,stages,tile (the launch dicts' keys but spread, which changes only the
grid); blocks of --block channels in a
cache of --channels.  What ptxas reports is what the GPU would run: a kernel that spills is
latency-bound (the first version held 255 registers and spilled: ncu, 2026-12-02).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cachegen_cli.kernels import fixed_rotation as fx  # noqa: E402
from cachegen_cli.kernels import fixed_rotation_matmul as fm  # noqa: E402


def compile_ptx(fn, signature: dict, constexprs: dict, arch: int, warps: int, stages: int) -> str:
    src = ASTSource(fn, signature, constexprs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages}).asm["ptx"]


def ptxas_report(ptx: str, arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton itself runs for arch

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(ptx)
        r = subprocess.run([str(ptxas), "-v", f"--gpu-name=sm_{arch}a", str(p), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)
    out = r.stdout + r.stderr
    regs = re.findall(r"Used (\d+) registers", out)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return f"{regs[-1] if regs else '?'} registers, spills {spill[-1] if spill else '?'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--channels", type=int, default=1024)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--configs", default="64,4,2,64;128,8,2,64")
    a = ap.parse_args()
    C, D = a.channels, a.block
    H = C // D
    for item in a.configs.split(";"):
        rows, warps, stages, tile = (int(v) for v in item.split(",")[:4])
        common = dict(C=C, H=H, D=D, DP=triton.next_power_of_2(D), BM=rows, BN=fm._tile(D, tile))
        enc_sig = {"x_ptr": "*i16", "e_ptr": "*i32", "r_ptr": "*i8", "y_ptr": "*fp32", "T": "i64", "n": "i64",
                   "t_first": "i64", "plane_digits": "i64", "tiles": "i64",
                   **{k: "constexpr" for k in (*common, "BF16_WORDS", "XB", "RB")}}
        enc = compile_ptx(fm._rotate_rows_kernel, enc_sig, dict(common, BF16_WORDS=True, XB=fx.X_BITS, RB=fx.R_BITS),
                          a.arch, warps, stages)
        dec_sig = {"z_ptr": "*i16", "r_ptr": "*i8", "sums_ptr": "*i64", "steps_ptr": "*fp64", "b_ptr": "*fp64",
                   "out_ptr": "*i16", "T": "i64", "n": "i64", "t_first": "i64", "plane_digits": "i64",
                   "tiles": "i64", **{k: "constexpr" for k in (*common, "BF16_OUT", "F32_MAX", "LEVEL_WORDS")}}
        dec = compile_ptx(fm._unrotate_values_kernel, dec_sig,
                          dict(common, BF16_OUT=True, F32_MAX=fm._F32_MAX, LEVEL_WORDS=True), a.arch, warps, stages)
        print(f"rows {rows} warps {warps} stages {stages} tile {common['BN']}: encode {ptxas_report(enc, a.arch)}; "
              f"decode {ptxas_report(dec, a.arch)}", flush=True)


if __name__ == "__main__":
    main()
