"""The ``cachegen`` command (Typer): the codec commands (``commands``), the model commands
(``model``, ``tune``) and the helpers they share (``common``)."""

from .commands import app, main

__all__ = ["app", "main"]
