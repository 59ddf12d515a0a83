"""The package's layout: no import cycles among its own modules.

Every import counts, also one deferred into a function: two modules that import each other
need each other whenever the import runs.  Self-contained (the same walk as
../shared/tools/import_cycles.py), so it runs on a clean clone."""

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: (folder in the repository, the package it installs as)
PACKAGES = (("cachegen_cli", "cachegen_cli"), ("kernels", "cachegen_cli.kernels"))


def _modules() -> dict[str, Path]:
    found = {}
    for top, pkg in PACKAGES:
        for folder, _, files in os.walk(ROOT / top):  # does not follow the cachegen_cli/kernels symlink
            for f in files:
                if f.endswith(".py"):
                    rel = Path(folder, f).relative_to(ROOT / top).with_suffix("").parts
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    found[".".join((pkg,) + rel)] = Path(folder, f)
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            b = base
            for _ in range(max(node.level - 1, 0)):
                b = b.rsplit(".", 1)[0]
            target = (b + "." + node.module if node.module else b) if node.level else node.module
            out |= {target} | {target + "." + a.name for a in node.names}
    return {t for t in out if t in known and t != name}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module."""
    index, low, on, stack, comps = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))
    return comps


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _strongly_connected(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    mods = _modules()
    assert "cachegen_cli.pipeline.codec" in mods and "cachegen_cli.kernels.cpu" in mods
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    cycles = [c for c in ([m for m in comp if mods[m].name != "__init__.py"] for comp in _strongly_connected(graph))
              if len(c) > 1]
    report = "\n".join(" -> ".join(c) + ": " + ", ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
                       for c in cycles)
    assert not cycles, f"import cycles:\n{report}"


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines at its top level (also inside a top-level if / try)."""
    names = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                body += handler.body
    return names


#: The package's stages, lowest first: a module imports only from its own stage or lower ones
#: ("package" is cachegen_cli/__init__.py, the public API, which model/ and cli/ import; "batch"
#: runs the API's file functions over many files, for cli/).
#: "integrations" (plug-ins for other systems, e.g. LMCache's serde) sits next to the CLI at
#: the top: test_nothing_imports_the_integrations keeps the two apart.
STAGES = ("errors", "kernels", "storage", "format", "methods", "pipeline", "api", "package", "batch", "model", "cli",
          "integrations")


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "package"


def test_imports_go_down_the_stages():
    mods = _modules()
    assert {_stage(m) for m in mods} == set(STAGES)
    up = sorted(f"{a} -> {b}" for a, p in mods.items() for b in _imports(a, p, mods)
                if STAGES.index(_stage(b)) > STAGES.index(_stage(a)))
    assert not up, "imports of a higher stage:\n" + "\n".join(up)


def test_nothing_imports_the_integrations():
    """The plug-ins build on the library (the API and the stages below it); the library, the
    model tools and the CLI never import them (they need packages the library does not)."""
    mods = _modules()
    assert "cachegen_cli.integrations.lmcache_serde" in mods
    bad = sorted(f"{a} -> {b}" for a, p in mods.items() for b in _imports(a, p, mods)
                 if (_stage(b) == "integrations") != (_stage(a) == "integrations")
                 and (_stage(b) == "integrations" or _stage(b) in ("model", "cli")))
    assert not bad, "imports across the integrations boundary:\n" + "\n".join(bad)


def test_every_import_of_the_package_resolves():
    """Each ``from X import y`` of the package's own modules, deferred ones included (some run
    only on a GPU), names a module that exists and a submodule or top-level name of it."""
    mods = _modules()
    defined = {m: _top_level_names(p) for m, p in mods.items()}
    bad = []
    for name, path in mods.items():
        base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            b = base
            for _ in range(max(node.level - 1, 0)):
                b = b.rsplit(".", 1)[0]
            target = (b + "." + node.module if node.module else b) if node.level else node.module
            if not target.startswith("cachegen_cli"):
                continue
            if target not in mods:
                bad.append(f"{name}:{node.lineno}: no module {target}")
                continue
            for a in node.names:
                if target + "." + a.name not in mods and a.name not in defined[target]:
                    bad.append(f"{name}:{node.lineno}: {target} has no {a.name}")
    assert not bad, "\n".join(bad)


def test_the_public_api():
    import cachegen_cli
    from cachegen_cli.cli import app, main

    assert callable(main) and app is not None
    assert set(cachegen_cli.__all__) == {"encode", "encode_to_device", "decode", "encode_file", "decode_file",
                                         "QuantizationConfig", "QuantizationSpec", "CacheGenError", "__version__"}
