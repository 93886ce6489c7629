"""Command implementations registered on the Typer app in ``maskkv_cli.cli``."""
