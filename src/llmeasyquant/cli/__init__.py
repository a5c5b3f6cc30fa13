"""The `llmeasyquant` command: `main` parses and dispatches; each subcommand is one module beside it."""

from llmeasyquant.cli.main import main

__all__ = ["main"]
