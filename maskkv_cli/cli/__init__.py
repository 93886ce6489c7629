"""The command line: the Typer app, options declared once, Rich renderers and one module per command group.

The only package that imports Typer or Rich; everything below it is the library.
"""

from maskkv_cli.cli.app import app, main

__all__ = ["app", "main"]
