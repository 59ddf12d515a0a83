"""Plug-ins for other systems, on top of the library (``lmcache_serde``: a serde for LMCache).

The top stage of the package: a module here imports the API and the pipeline, and nothing in
the package imports it (tests/test_layout.py checks), so that the library never needs the
systems these plug into."""
