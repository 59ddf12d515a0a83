"""cachegen: compress the KV caches of large language models.

The library comes first and the ``cachegen`` command is a thin layer over it:

    from cachegen_cli import encode, decode
    blob = encode(kv)          # kv: torch tensor [layers, 2, tokens, kv_heads, head_dim]
    tensors = decode(blob)     # {"kv": tensor}, same shape and dtype
"""

from .api import decode, decode_file, encode, encode_file, encode_to_device
from .methods.config import QuantizationConfig, QuantizationSpec
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
