"""A/B of two checkouts on one GPU: ``bench_device.py`` run from each tree in turn (old, new, old,
new, ...), in one machine session, then a table of each method's encode / decode GB/s per run and
of the stages whose medians moved.  Lent machines differ by 5-15% on the host side, so a change is
only measured against a baseline run on the same machine, alternated to spread the drift.

    git worktree add /tmp/old HEAD~1
    python benchmarks/ab_trees.py --old /tmp/old --new . --rounds 2 \\
        --methods high,high+cal/head+rope --out /tmp/ab      # JSONs and logs land in --out
    python benchmarks/ab_trees.py --old . --new . --new-env CACHEGEN_PRODUCT_LEVELS=1 --out /tmp/ab2

Each tree runs its own ``benchmarks/bench_device.py`` with its own package first on the import
path, and ``cachegen_cli/kernels`` must point at its top-level ``kernels/`` (``--link`` makes that
symbolic link where it is missing, and links ``sample_data/`` to the other tree's in a tree exported
without it; without it, an installed package would lend its own kernels).  ``--summarize`` prints
the table again from the JSONs an earlier call left in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: A stage's median moved when it changed by more than this fraction (and 0.02 ms).
MOVED = 0.03


def run_order(rounds: int) -> list[tuple[str, int]]:
    """(tag, round) of each run: old and new alternated, old first."""
    return [(tag, r) for r in range(1, rounds + 1) for tag in ("old", "new")]


def link_kernels(tree: Path) -> None:
    """cachegen_cli/kernels -> ../kernels in ``tree`` when neither a link nor a folder is there."""
    target = tree / "cachegen_cli" / "kernels"
    if not target.exists() and not target.is_symlink():
        target.symlink_to(Path("..") / "kernels")


def link_sample(tree: Path, others: list[Path]) -> None:
    """sample_data -> the first of ``others``' sample_data/ in ``tree`` when it has none (a tree
    exported with ``git archive`` of the code alone; bench_device.py builds its cache from it)."""
    target = tree / "sample_data"
    if target.exists() or target.is_symlink():
        return
    for other in others:
        if (other / "sample_data").is_dir():
            target.symlink_to((other / "sample_data").resolve())
            return


def bench_command(tree: Path, json_path: Path, args) -> list[str]:
    cmd = [sys.executable, str(tree / "benchmarks" / "bench_device.py"), "--tokens", str(args.tokens), "--repeats",
           str(args.repeats), "--check-tokens", str(args.check_tokens), "--methods", args.methods, "--json",
           str(json_path)]
    return cmd + (args.extra.split() if args.extra else [])


def run_env(base: dict, tree: Path, assignments: str) -> dict:
    """The environment of a tree's runs: ``base`` with PYTHONPATH the tree and each NAME=VALUE of
    ``assignments`` (space-separated: a switch such as CACHEGEN_PRODUCT_LEVELS=1 for one side)."""
    env = dict(base, PYTHONPATH=str(tree))
    for item in assignments.split():
        name, eq, value = item.partition("=")
        if not name or not eq:
            raise ValueError(f"not NAME=VALUE: {item!r}")
        env[name] = value
    return env


def rows_by_method(result: dict) -> dict[str, dict]:
    return {r["method"]: r for r in result["rows"]}


def summarize(runs: list[tuple[str, int, dict]]) -> list[str]:
    """Lines of the comparison: per method, each run's encode / decode GB/s (old runs, then new),
    whether CPU and GPU bytes agreed in every run, and the stages whose median over the runs of
    one tree moved by more than MOVED between old and new."""
    lines = []
    methods: list[str] = []
    for _, _, res in runs:
        for m in rows_by_method(res):
            if m not in methods:
                methods.append(m)
    for m in methods:
        cells = {"old": [], "new": []}
        stages = {"old": {}, "new": {}}
        same = True
        for tag, _, res in runs:
            row = rows_by_method(res).get(m)
            if row is None:
                continue
            cells[tag].append(f"{row['encode_GBps']:.1f}/{row['decode_GBps']:.1f}")
            same = same and bool(row.get("identical_cpu_gpu_bytes", True))
            for side in ("encode", "decode"):
                for name, ms in row.get(f"{side}_stages_ms", []):
                    stages[tag].setdefault(f"{side}: {name}", []).append(ms)
        lines.append(f"{m:26s} old {' '.join(cells['old']) or '-':28s} new {' '.join(cells['new']) or '-':28s}"
                     f" CPU == GPU bytes {'yes' if same else 'NO'}")
        for name in stages["old"]:
            if name not in stages["new"]:
                continue
            a, b = statistics.median(stages["old"][name]), statistics.median(stages["new"][name])
            if abs(b - a) > max(MOVED * a, 0.02):
                lines.append(f"    {name:40s} {a:7.3f} -> {b:7.3f} ms")
    return lines


def load_runs(out: Path) -> list[tuple[str, int, dict]]:
    runs = []
    for path in sorted(out.glob("*_r*.json")):
        tag, _, r = path.stem.rpartition("_r")
        if tag in ("old", "new") and r.isdigit():
            runs.append((tag, int(r), json.loads(path.read_text())))
    runs.sort(key=lambda x: (x[1], x[0] != "old"))
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, help="the baseline checkout")
    p.add_argument("--new", type=Path, help="the checkout with the change")
    p.add_argument("--out", type=Path, required=True, help="folder for each run's JSON and log")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", default="high,high+cal/head+rope")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--extra", default="", help="more arguments for bench_device.py (both trees)")
    p.add_argument("--old-env", default="", help="NAME=VALUE ... set for the old tree's runs only")
    p.add_argument("--new-env", default="", help="NAME=VALUE ... set for the new tree's runs only (--old and "
                   "--new may then be one tree: a switch against its default)")
    p.add_argument("--timeout", type=int, default=300, help="seconds a run may take")
    p.add_argument("--link", action="store_true",
                   help="link cachegen_cli/kernels, and sample_data/ to the other tree's, in a tree that lacks them")
    p.add_argument("--summarize", action="store_true", help="only print the table of the JSONs in --out")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.summarize:
        if a.old is None or a.new is None:
            p.error("--old and --new are needed unless --summarize")
        trees = {"old": a.old.resolve(), "new": a.new.resolve()}
        try:
            envs = {tag: run_env(os.environ, trees[tag], getattr(a, f"{tag}_env")) for tag in trees}
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        for tag, tree in trees.items():
            if not (tree / "benchmarks" / "bench_device.py").is_file():
                print(f"error: {tag} tree {tree} has no benchmarks/bench_device.py", file=sys.stderr)
                return 1
            if a.link:
                link_kernels(tree)
                link_sample(tree, [t for t in trees.values() if t != tree])
            if not (tree / "cachegen_cli" / "kernels").exists():
                # (an installed package would otherwise lend the tree its own kernels)
                print(f"error: {tag} tree {tree} has no cachegen_cli/kernels: pass --link", file=sys.stderr)
                return 1
            if not (tree / "sample_data").is_dir():
                print(f"error: {tag} tree {tree} has no sample_data/ (bench_device.py's cache): pass --link, "
                      "with the other tree holding it", file=sys.stderr)
                return 1
        for tag, r in run_order(a.rounds):
            tree = trees[tag]
            json_path = a.out / f"{tag}_r{r}.json"
            log = a.out / f"{tag}_r{r}.txt"
            env = envs[tag]
            with open(log, "w") as fh:
                try:
                    rc = subprocess.run(bench_command(tree, json_path, a), cwd=tree, env=env, stdout=fh,
                                        stderr=subprocess.STDOUT, timeout=a.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            print(f"{tag} round {r}: {'ok' if rc == 0 else f'failed ({rc}), see {log}'}", flush=True)
    runs = load_runs(a.out)
    if not runs:
        print(f"error: no run's JSON in {a.out}", file=sys.stderr)
        return 1
    print("\n".join(summarize(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
