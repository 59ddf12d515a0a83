"""Orchestration: .cgen files and streams encoded and decoded on the host (``codec``), and the
device paths it dispatches to (``lmcache_device``, ``transform_resident``)."""
