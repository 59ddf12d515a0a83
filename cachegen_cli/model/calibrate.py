"""``cachegen calibrate``: a calibration file (methods/calibration.py) from sample caches and,
with ``--sensitivity``, the model they were captured with (its per-plane sensitivities,
``tune.sensitivity_from_caches``)."""

from __future__ import annotations

from pathlib import Path

from ..methods.calibration import Calibration, fit, save


def calibrate_files(inputs: list, output, *, layout: str = "auto", sensitivity: bool = False, model_path=None,
                    loaded=None, force: bool = False, log=None, per_head: bool = False, rope_keys: bool = False,
                    rope_theta: float | None = None) -> Calibration:
    """``cachegen calibrate``: fit the rotation on the sample caches (KV .safetensors files) and,
    with ``sensitivity``, measure the per-plane sensitivities with the model the caches were
    captured with (their token ids come from ``cachegen capture``'s metadata); write the file
    atomically.  ``per_head``: one rotation block per KV head (methods/calibration.fit).  ``rope_keys``:
    fit on the keys without their RoPE (each cache's metadata, or plain ``rope_theta``
    frequencies), recorded in the calibration so that encoding with it removes the same.  ``loaded``: an already loaded (model, tokenizer) or a function returning one."""
    from ..storage import kvio
    from ..storage.outputs import check_output

    paths = [Path(p) for p in inputs]
    check_output(Path(output), paths, force)
    from .calibrate_parts import calibrate_parts, read_samples

    parts = read_samples(paths, layout)
    if parts is not None and (rope_keys or rope_theta is not None):
        from ..errors import ConfigError

        raise ConfigError("rope_keys applies to caches of one shape, not to multi-part caches (yet)",
                          cli="--rope-keys applies to caches of one shape, not to multi-part caches (yet)")
    if parts is not None:  # caches of several shapes: one rotation per plane kind and layer (calibration v3)
        return calibrate_parts(parts, output, sensitivity=sensitivity, per_head=per_head)
    caches = [kvio.read_safetensors(p, layout) for p in paths]
    data = [c.data for c in caches]
    used = None
    if rope_keys or rope_theta is not None:
        # Fitted on the keys as the encoder will code them: without their RoPE (each cache's own
        # positions); the calibration records the RoPE, so encoding with it removes the same one.
        import dataclasses

        from ..methods import rope as rope_methods
        from ..methods.config import TransformConfig

        cfg = TransformConfig(rope_keys=True)
        data = []
        for c in caches:
            if rope_theta is not None:
                c.rope = rope_methods.from_theta(rope_theta, c.head_dim)
            r = rope_methods.resolve(c, cfg)
            data.append(rope_methods.unturn(c.data, r))
            used = used or dataclasses.replace(r, position_start=0)
    fitted = fit(data, blocks=caches[0].num_kv_heads if per_head else 1)
    if used is not None:
        fitted = Calibration(fitted.rotation, dict(fitted.metadata, rope=rope_methods.to_metadata(used)), fitted.sensitivity)
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
