"""Tools that run a language model: capture, evaluation, tuning, sensitivity calibration and
file statistics."""
