"""Results as data: the profile report behind ``maskkv profile`` (runs, per-head budgets, page map) and the answers'
rows of ``ask``, ``profile`` and ``batch`` (``answers.py``); the renderers live in ``maskkv_cli.cli``."""
