"""``python -m cachegen_cli.cli``: the ``cachegen`` command."""

from .commands import main

main()
