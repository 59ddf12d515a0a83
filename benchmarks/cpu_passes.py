"""Time two CPU passes of a calibrated encode on one thread, at this tree and, for a before /
after comparison, at another checkout of the project (``--before DIR``, e.g. a ``git worktree``
of an older commit): ``kernels/checks.first_nonfinite_row`` (the finiteness check of a
bfloat16 cache's words, storage/kvio) and ``kernels/rope.turn_keys`` (the keys turned back by
their RoPE, one row of frequencies).  Each tree's ``kernels`` package is loaded from its own
folder, so both run in one process on the same data; the script also says whether both trees
give the same bits.

    NUMBA_NUM_THREADS=1 python benchmarks/cpu_passes.py --before /tmp/old-tree

Prints the median (min-max) of --repeats calls after a warm-up call.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def load_kernels(tree: Path, tag: str):
    """The ``kernels`` package of ``tree`` under the module name kernels_<tag> (its relative
    imports stay inside it)."""
    name = f"kernels_{tag}"
    spec = importlib.util.spec_from_file_location(name, tree / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(tree / "kernels")])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    return (importlib.import_module(f"{name}.checks"), importlib.import_module(f"{name}.rope"))


def timed_ms(fn, repeats: int) -> tuple[float, float, float]:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times), max(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="another checkout of the project, timed on the same data")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--channels", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from cachegen_cli.methods import rope as rope_methods

    L, T, C = a.layers, a.tokens, a.channels
    rng = np.random.default_rng(0)
    x = rng.standard_normal((L, 2, T, C)).astype(np.float32)
    words = (x.view(np.uint32) >> 16).astype(np.uint16).reshape(L, -1)  # a bfloat16 cache's words
    rope = rope_methods.from_theta(500000.0, 128)
    print(f"{L} layers x 2 x {T} tokens x {C} channels: {words.nbytes / 1e6:.0f} MB of bfloat16 words, "
          f"keys turned as float32 ({x.nbytes / 2e6:.0f} MB); one thread, median (min-max) of {a.repeats}")
    trees = [("this tree", ROOT)] + ([("--before", a.before.resolve())] if a.before else [])
    results = {}
    for i, (label, tree) in enumerate(trees):
        checks, rk = load_kernels(tree, str(i))
        row = checks.first_nonfinite_row(words, 0x7F80)
        m = timed_ms(lambda: checks.first_nonfinite_row(words, 0x7F80), a.repeats)
        print(f"{label:10s} first_nonfinite_row {m[0]:7.1f} ms ({m[1]:.1f}-{m[2]:.1f})  -> {row}", flush=True)
        y = x.copy()
        rk.turn_keys(y, rope.inv_freq, rope, 0, 4, False)
        results[label] = (row, y)
        copies = [x.copy() for _ in range(a.repeats + 1)]
        it = iter(copies)
        m = timed_ms(lambda: rk.turn_keys(next(it), rope.inv_freq, rope, 0, 4, False), a.repeats)
        print(f"{label:10s} turn_keys           {m[0]:7.1f} ms ({m[1]:.1f}-{m[2]:.1f})", flush=True)
    if len(results) == 2:
        (r0, y0), (r1, y1) = results.values()
        print(f"same results: {r0 == r1 and np.array_equal(y0.view(np.int32), y1.view(np.int32))}")


if __name__ == "__main__":
    main()
