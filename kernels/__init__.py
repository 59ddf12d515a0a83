"""Numba kernels of the codec, one module per stage.

- ``coding_params``: constants that are part of the .cgen format.
- ``quantize``: per-token abs-max quantization (device functions).
- ``cdf``: symbol counts -> 4-bit codes -> integer CDFs (device functions).
- ``range_coder``: one range-coded stream (device functions).
- ``cpu``: @njit kernels over whole slabs of chunks.
- ``cuda``: numba-cuda kernels with the same signatures and bytes.

Device functions are ``register_jitable``: the same source compiles for the CPU
and for CUDA, which is how the two paths produce identical bytes.
"""
