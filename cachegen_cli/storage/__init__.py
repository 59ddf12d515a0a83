"""KV caches in and out of files: safetensors layouts and KV tensors (``kvio``), safe atomic
outputs (``outputs``)."""
