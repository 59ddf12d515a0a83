"""What each method computes on the host: the quantization tables and presets (``config``),
the calibration files the transform method reads (``calibration``) and the transform /
lossless method of format version 2 (``transform``)."""
