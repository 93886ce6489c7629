"""Results as data: the profile report behind ``maskkv profile`` (runs, per-head budgets, page map);
the renderers live in ``maskkv_cli.cli``."""
