"""Time the fixed-point rotation alone, both directions, on a Llama-3.1-8B-shaped plane set (32
layers x 2 x TOKENS x 1024 channels, bfloat16 in): the matrix-unit kernels of
kernels/fixed_rotation_matmul.py against the float64 path they replace (fixed_rows, cuBLAS's
float64 product, fixed_rows_out / fixed_values), checking that both give the same bits, the
decoder from float32 levels and from int16 words; with --sweep, over tile shapes, warps and
programs a multiprocessor.

    python benchmarks/profile_fixed_rotation.py --tokens 8192 --blocks 8 --sweep

The rows are random with a spread of channel scales (timing only: not a quality figure).
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import gpu_event_times  # noqa: E402

from cachegen_cli.kernels import cuda_pipeline as k  # noqa: E402
from cachegen_cli.kernels import fixed_rotation as fx  # noqa: E402
from cachegen_cli.kernels import fixed_rotation_matmul as fm  # noqa: E402
from cachegen_cli.pipeline.transform_resident import _nb  # noqa: E402


def timed_ms(fn, repeats: int) -> tuple[float, float, float]:
    """Median, min and max milliseconds of fn (bench.gpu_event_times)."""
    ms = [t * 1e3 for t in gpu_event_times(fn, repeats)]
    return statistics.median(ms), min(ms), max(ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--configs", default="", help='"rows,warps,stages,tile,spread;..." (both directions; past RESIDENT_BLOCK: rows,warps,stages,tile,depth)')
    ap.add_argument("--rope", action="store_true",
                    help="also time both directions turning the keys by a RoPE (heads of 128, theta 500000)")
    ap.add_argument("--rope-configs", default="", help='"rows,pairs,warps;..." of the turning pass')
    a = ap.parse_args()
    L, C, H, T, S = 32, 1024, a.blocks, a.tokens, 1
    D = C // H
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = torch.exp(torch.randn(C, device="cuda", generator=g) * 1.5)
    x = (torch.randn(L, 2, T, C, device="cuda", generator=g) * scale).to(torch.bfloat16)
    words = x.view(torch.int16)
    rot = np.empty((L, 2, H, D, D), np.float32)
    rng = np.random.default_rng(0)
    for i in np.ndindex(L, 2, H):
        rot[i] = np.linalg.qr(rng.standard_normal((D, D)))[0]
    rint = torch.from_numpy(fx.fixed_matrix(rot, False)).cuda()
    rint_t = torch.from_numpy(fx.fixed_matrix(rot, True)).cuda()
    dig, dig_t, sums = fm.rotation_digits(rint), fm.rotation_digits(rint_t), fm.column_sums(rint_t)
    nbytes = x.numel() * 2

    y_ref = torch.zeros(L, 2, T, C, device="cuda")
    Xr = torch.empty(L, 2, T - S, C, dtype=torch.float64, device="cuda")
    er = torch.empty(L, 2, T - S, dtype=torch.int32, device="cuda")

    def enc_f64():
        k.fixed_rows(_nb(words), S, _nb(Xr), _nb(er))
        Yr = fx.block_product(Xr, rint)
        k.fixed_rows_out(_nb(Yr), _nb(er), S, _nb(y_ref))

    y = torch.zeros_like(y_ref)
    enc_mm = lambda: fm.rotate_rows(words, dig, S, y)  # noqa: E731
    # levels q' (multiples of 1/256 in [-127.5, 127.5]) for the decoder
    q = (torch.randint(-127, 128, (L, 2, T, C), device="cuda", generator=g)
         + (torch.randint(0, 256, (L, 2, T, C), device="cuda", generator=g) - 127) / 256.0).float()
    steps = torch.full((L, 2), 0.0625, dtype=torch.float64, device="cuda")
    b = torch.randn(L, 2, C, dtype=torch.float64, device="cuda")
    out_ref = torch.zeros(L, 2, T, C, dtype=torch.int16, device="cuda")

    def dec_f64():
        A = fx.block_product(q[:, :, S:].to(torch.float64), rint_t)
        k.fixed_values(_nb(A), _nb(steps), _nb(b), S, _nb(out_ref))

    out = torch.zeros_like(out_ref)
    q_words = (q.to(torch.float64) * 256 - 1).to(torch.int16)
    dec_mm = lambda: fm.unrotate_values(q, dig_t, sums, steps, b, S, out)  # noqa: E731
    for name, fn in (("encode, float64 path", enc_f64), ("decode, float64 path", dec_f64)):
        med, lo, hi = timed_ms(fn, a.repeats)
        print(f"{name:28s} {med:7.2f} ms ({lo:.2f}-{hi:.2f})  {nbytes / med / 1e6:6.1f} GB/s of bf16", flush=True)
    default = tuple(fm.ENCODE_LAUNCH.values()), tuple(fm.DECODE_LAUNCH.values())
    configs = [default] if not a.sweep else [(c, c) for c in itertools.product((32, 64, 128), (4, 8), (2,), (64, 128), (1, 2))]
    if a.configs:  # "rows,warps,stages,tile,spread;..." for both directions
        configs = [(c, c) for c in (tuple(int(v) for v in item.split(",")) for item in a.configs.split(";"))]
    streaming = D > fm.RESIDENT_BLOCK  # the streaming kernels: configs "rows,warps,stages,tile,depth"
    if streaming and not a.configs:
        configs = [(tuple(fm.STREAM_ENCODE_LAUNCH.values()), tuple(fm.STREAM_DECODE_LAUNCH.values()))]
    if not fm.supports(D):
        print(f"blocks of {D} channels: past the matrix-unit kernels (fixed_rotation_matmul.MAX_BLOCK)")
        configs = []
    for enc_cfg, dec_cfg in configs:
        names = ("rows", "warps", "stages", "tile", "depth" if streaming else "spread")
        if streaming:
            fm.STREAM_ENCODE_LAUNCH, fm.STREAM_DECODE_LAUNCH = dict(zip(names, enc_cfg)), dict(zip(names, dec_cfg))
        else:
            fm.ENCODE_LAUNCH, fm.DECODE_LAUNCH = dict(zip(names, enc_cfg)), dict(zip(names, dec_cfg))
        label = (f"encode {enc_cfg} decode {dec_cfg}" if enc_cfg != dec_cfg
                 else f"rows/warps/stages/tile/{names[-1]} {enc_cfg}")
        try:
            y.fill_(1.0)
            out.fill_(7)
            me = timed_ms(enc_mm, a.repeats)
            md = timed_ms(dec_mm, a.repeats)
        except Exception as e:  # noqa: BLE001 - a config the compiler refuses: say so, go on
            print(f"{label}: failed ({type(e).__name__}: {str(e)[:120]})")
            continue
        same_e = torch.equal(y[:, :, S:].view(torch.int32), y_ref[:, :, S:].view(torch.int32))
        same_d = torch.equal(out[:, :, S:], out_ref[:, :, S:])
        out.fill_(7)  # the levels as int16 words Q = 256 q' - 1 (the pipeline's decoder)
        mw = timed_ms(lambda: fm.unrotate_values(q_words, dig_t, sums, steps, b, S, out), a.repeats)
        same_w = torch.equal(out[:, :, S:], out_ref[:, :, S:])
        print(f"{label}: encode {me[0]:6.2f} ms ({me[1]:.2f}-{me[2]:.2f}) decode {md[0]:6.2f} ms "
              f"({md[1]:.2f}-{md[2]:.2f})  {nbytes / me[0] / 1e6:6.1f} / {nbytes / md[0] / 1e6:6.1f} GB/s  "
              f"same bits {same_e}/{same_d}; decode from int16 levels {mw[0]:6.2f} ms ({mw[1]:.2f}-{mw[2]:.2f}) "
              f"same bits {same_w}", flush=True)


    if a.rope:
        rope_rows(a, words, dig, dig_t, sums, q_words, steps, b, S, nbytes)


def rope_rows(a, words, dig, dig_t, sums, q_words, steps, b, S, nbytes) -> None:
    """Both directions with the keys turned by a RoPE (fm.RopeAngles), against the same launches
    without it, at each of --rope-configs of the turning pass (fm.TURN_LAUNCH)."""
    from cachegen_cli.methods import rope as rope_methods
    from cachegen_cli.pipeline.transform_resident import _rope_angles

    L, _, T, C = words.shape
    r = rope_methods.from_theta(500000.0, 128)
    ang = _rope_angles(r, S, T, words.device)
    y = torch.zeros(words.shape, device="cuda")
    out = torch.zeros(words.shape, dtype=torch.int16, device="cuda")
    keys = torch.zeros((L, 1, T, C), device="cuda")
    plain = (("encode, no RoPE", lambda: fm.rotate_rows(words, dig, S, y)),
             ("decode, no RoPE", lambda: fm.unrotate_values(q_words, dig_t, sums, steps, b, S, out)))
    for label, fn in plain:
        med, lo, hi = timed_ms(fn, a.repeats)
        print(f"{label:28s} {med:7.2f} ms ({lo:.2f}-{hi:.2f})  {nbytes / med / 1e6:6.1f} GB/s of bf16", flush=True)
    configs = [tuple(fm.TURN_LAUNCH.values())]
    if a.rope_configs:
        configs = [tuple(int(v) for v in item.split(",")) for item in a.rope_configs.split(";")]
    for cfg in configs:
        fm.TURN_LAUNCH = dict(zip(("rows", "pairs", "warps"), cfg))
        try:
            me = timed_ms(lambda: fm.rotate_rows(words, dig, S, y, rope=ang), a.repeats)
            # the values' words straight from the product, the keys' float32 values apart, then
            # turned into the words (the pipeline's decoder)
            md = timed_ms(lambda: (fm.unrotate_values(q_words, dig_t, sums, steps, b, S, out, keys=keys),
                                   fm.turn_rows(keys, ang, S, out, True)), a.repeats)
        except Exception as e:  # noqa: BLE001 - a config the compiler refuses: say so, go on
            print(f"RoPE, turning pass {cfg}: failed ({type(e).__name__}: {str(e)[:120]})")
            continue
        print(f"RoPE, turning pass {cfg}: encode {me[0]:6.2f} ms ({me[1]:.2f}-{me[2]:.2f}) decode {md[0]:6.2f} ms "
              f"({md[1]:.2f}-{md[2]:.2f})  {nbytes / me[0] / 1e6:6.1f} / {nbytes / md[0] / 1e6:6.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
