"""Many documents and questions at once: job planning and keys, the results folder, pools of workers (this
process, local processes, Ray actors). No Rich or Typer here; ``maskkv batch`` (cli/commands/batch.py) renders."""
