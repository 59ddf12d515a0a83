"""``cachegen calibrate``: a calibration file (methods/calibration.py) from sample caches and,
with ``--sensitivity``, the model they were captured with (its per-plane sensitivities,
``tune.sensitivity_from_caches``)."""

from __future__ import annotations

from pathlib import Path

from ..methods.calibration import Calibration, fit, save


def fit_samples(data: list, num_kv_heads: int, ropes: list | None = None, per_head: bool = True) -> Calibration:
    """The rotation of a calibration, fitted on sample caches ``data`` (tensors [L, 2, T, C]) of
    a model with ``num_kv_heads`` KV heads: one block per KV head (``per_head``, the default),
    else one full C x C matrix per (layer, K/V).  ``ropes`` (one format.params.Rope per sample,
    each at its own positions): fitted on the keys without their RoPE, which the calibration
    records, so that encoding with it removes the same (docs/config.md: per head on RoPE-free
    keys is smaller than a full rotation on every cache measured, at 1/heads of its arithmetic)."""
    import dataclasses

    from ..methods import rope as rope_methods

    used = None
    if ropes is not None:
        data = [rope_methods.unturn(x, r) for x, r in zip(data, ropes)]
        used = dataclasses.replace(ropes[0], position_start=0)
    fitted = fit(data, blocks=num_kv_heads if per_head else 1)
    if used is not None:
        fitted = Calibration(fitted.rotation, dict(fitted.metadata, rope=rope_methods.to_metadata(used)),
                             fitted.sensitivity)
    return fitted


def _sample_ropes(caches: list, rope_keys: bool | None, rope_theta: float | None) -> list | None:
    """Each sample cache's RoPE when the keys are fitted without it: asked (``rope_keys`` True or a
    ``rope_theta``: every cache must have one), or by default (None) when every cache records one
    (`cachegen capture` does); else None."""
    from ..errors import ConfigError
    from ..methods import rope as rope_methods
    from ..methods.config import TransformConfig

    if rope_keys is False:
        return None
    cfg = TransformConfig(rope_keys=True)
    ropes = []
    for c in caches:
        if rope_theta is not None:
            c.rope = rope_methods.from_theta(rope_theta, c.head_dim)
        try:
            ropes.append(rope_methods.resolve(c, cfg))
        except ConfigError:
            if rope_keys:
                raise
            return None
    return ropes


def calibrate_files(inputs: list, output, *, layout: str = "auto", sensitivity: bool = False, model_path=None,
                    loaded=None, force: bool = False, log=None, per_head: bool | None = None, rope_keys: bool | None = None,
                    rope_theta: float | None = None) -> Calibration:
    """``cachegen calibrate``: fit the rotation on the sample caches (KV .safetensors files) and,
    with ``sensitivity``, measure the per-plane sensitivities with the model the caches were
    captured with (their token ids come from ``cachegen capture``'s metadata); write the file
    atomically.  ``rope_keys``: fit on the keys without their RoPE (each cache's metadata, or
    plain ``rope_theta`` frequencies), recorded in the calibration so that encoding with it removes
    the same; None (default): when every sample records its RoPE.  ``per_head``: one rotation
    block per KV head, else one full matrix (fit_samples); None (default): per head on keys
    without their RoPE, else full (the smaller file either way, docs/config.md; a full rotation
    codes at ~1/3 of a per-head one's GPU speed).  ``loaded``: an already loaded (model,
    tokenizer) or a function returning one."""
    from ..storage import kvio
    from ..storage.outputs import check_output

    paths = [Path(p) for p in inputs]
    check_output(Path(output), paths, force)
    from .calibrate_parts import calibrate_parts, read_samples

    parts = read_samples(paths, layout)
    if parts is not None and (rope_keys or rope_theta is not None):  # (by default multi-part samples keep their RoPE)
        from ..errors import ConfigError

        raise ConfigError("rope_keys applies to caches of one shape, not to multi-part caches (yet)",
                          cli="--rope-keys applies to caches of one shape, not to multi-part caches (yet)")
    if parts is not None:  # caches of several shapes: one rotation per plane kind and layer (calibration v3)
        return calibrate_parts(parts, output, sensitivity=sensitivity, per_head=bool(per_head))
    caches = [kvio.read_safetensors(p, layout) for p in paths]
    # Fitted on the keys as the encoder will code them: without their RoPE (each cache's own
    # positions) where the samples know it.
    ropes = _sample_ropes(caches, rope_keys if rope_theta is None else True, rope_theta)
    fitted = fit_samples([c.data for c in caches], caches[0].num_kv_heads, ropes,
                         ropes is not None if per_head is None else per_head)
    if sensitivity:
        from . import evaluate
        from .capture import ModelError, _resolve_loaded, model_id, resolve_model_path
        from .tune import sensitivity_from_caches

        samples = []
        for p, c in zip(paths, caches):
            kv = evaluate.KVFile(p, "safetensors", c.data, c.num_kv_heads, c.head_dim, c.layout, dict(c.metadata), 0)
            try:
                ids = evaluate.context_of(kv)
            except evaluate.NoTokenIdsError:
                raise evaluate.NoTokenIdsError(
                    f"{p} carries no token ids; sensitivity=True needs caches made by `cachegen capture`",
                    cli=f"{p} carries no token ids; --sensitivity needs caches made by `cachegen capture`") from None
            samples.append((c.data, ids))
        model, _ = _resolve_loaded(loaded, resolve_model_path(model_path), log)
        shape = evaluate.model_shape(model)
        for p, c in zip(paths, caches):
            if (c.num_layers, c.num_kv_heads, c.head_dim) != shape:
                raise ModelError(f"{p} has {c.num_layers} layers x {c.num_kv_heads} KV heads x {c.head_dim} dims, "
                                 f"the model {model_id(model)} {shape[0]} x {shape[1]} x {shape[2]}")
        s = sensitivity_from_caches(model, samples, caches[0].num_kv_heads, caches[0].head_dim, log=log)
        fitted = fitted.with_sensitivity(s, f"model {model_id(model)}, {len(samples)} sample(s)")
    save(fitted, output)
    return fitted
