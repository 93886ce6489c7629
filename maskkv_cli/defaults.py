"""Settings: the policy, budget and layer-budget defaults, the real model every hint names, and the user's own
default model (``MASKKV_MODEL`` or the config file).

A leaf: it imports no stage of the flow. Which model a run uses when ``--model`` is not given (the user's default,
else the embedded tiny model, else a random demo model) is ``models.catalog.resolve_default_model``.
"""

from __future__ import annotations

import os
import tomllib

from maskkv_cli.errors import UsageError
from maskkv_cli.paths import config_file

# The policy of ask, summarize, generate, profile, demo and ``CacheConfig`` without --policy, and the reference of
# ``bench quality``'s task-by-task comparison: the paper's MaskKV as published, so that numbers compare with the
# paper's tables. Our variants (``maskkv-plus`` and others) are opt-in; docs/policies.md says why.
DEFAULT_POLICY = "maskkv"
# Entries per head per layer an evicting policy keeps when no --budget / --ratio is given.
DEFAULT_BUDGET = 256
# What --layer-budgets takes: the calibration profile if any (auto), measured on the input (online), uniform.
LAYER_BUDGET_CHOICES = ("auto", "online", "uniform")

# The real checkpoint every hint names, and the command that fetches it.
REAL_MODEL = "GSAI-ML/LLaDA-8B-Instruct"
PULL_HINT = f"maskkv pull {REAL_MODEL}"


def configured_model() -> str | None:
    """``MASKKV_MODEL``, else ``model = ...`` in the config file, else None."""
    if os.environ.get("MASKKV_MODEL"):
        return os.environ["MASKKV_MODEL"]
    path = config_file()
    if path.is_file():
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"cannot read config file {path}: {exc}") from None
        value = data.get("model")
        if value:
            return str(value)
    return None
