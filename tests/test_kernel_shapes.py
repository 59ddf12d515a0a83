"""numba-cuda takes the shape of a ``cuda.local.array`` / ``cuda.shared.array`` only as a
compile-time constant: an integer literal or a name bound outside the kernel (a global or a
closure variable), or a tuple of those.  An expression of such names (``LEVELS * V``) is typed as
an int64 and the kernel does not compile on a GPU, while numba's simulator, which ``make test``
runs, accepts any size (542d847's tree statistics kernel failed so on the first GPU run).  This
checks every kernel source's array shapes statically."""

import ast
from pathlib import Path

import pytest

KERNELS = sorted((Path(__file__).resolve().parents[1] / "kernels").glob("*.py"))


def _array_calls(tree: ast.AST):
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if (isinstance(f, ast.Attribute) and f.attr == "array" and isinstance(f.value, ast.Attribute)
                and f.value.attr in ("local", "shared") and isinstance(f.value.value, ast.Name)
                and f.value.value.id == "cuda"):
            yield node


def _constant_shape(node: ast.AST) -> bool:
    if isinstance(node, ast.Tuple):
        return all(_constant_shape(e) for e in node.elts)
    return isinstance(node, ast.Name) or (isinstance(node, ast.Constant) and isinstance(node.value, int))


def bad_shapes(source: str) -> list[int]:
    """Line numbers of array calls in ``source`` whose shape is not a literal or a plain name."""
    bad = []
    for call in _array_calls(ast.parse(source)):
        shape = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "shape"), None)
        if shape is None or not _constant_shape(shape):
            bad.append(call.lineno)
    return bad


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_kernel_array_shapes_are_constants(path):
    assert bad_shapes(path.read_text()) == []


def test_the_check_finds_an_expression():
    src = ("from numba import cuda\nimport numpy as np\n"
           "def k():\n    a = cuda.local.array(V, np.float64)\n    b = cuda.local.array(LEVELS * V, np.float64)\n"
           "    c = cuda.shared.array((R, 32), np.int32)\n    d = cuda.shared.array((R, W + 1), np.int32)\n")
    assert bad_shapes(src) == [5, 7]
