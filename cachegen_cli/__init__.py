"""cachegen: compress the KV caches of large language models.

The library comes first and the ``cachegen`` command is a thin layer over it:

    from cachegen_cli import encode, decode
    blob = encode(kv)          # kv: torch tensor [layers, 2, tokens, kv_heads, head_dim]
    tensors = decode(blob)     # {"kv": tensor}, same shape and dtype

The names below are imported on first use (PEP 562), so that ``import cachegen_cli`` and
``cachegen --help`` do not load torch and numba.
"""

from .errors import CacheGenError

__version__ = "0.1.0"
__all__ = [
    "encode",
    "encode_to_device",
    "decode",
    "encode_file",
    "decode_file",
    "QuantizationConfig",
    "QuantizationSpec",
    "CacheGenError",
    "__version__",
]

_LAZY = {
    "encode": "api",
    "encode_to_device": "api",
    "decode": "api",
    "encode_file": "api",
    "decode_file": "api",
    "QuantizationConfig": "methods.config",
    "QuantizationSpec": "methods.config",
}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
