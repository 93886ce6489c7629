"""Where maskkv keeps its files: ``MASKKV_HOME`` (default: the per-user cache folder)."""

from __future__ import annotations

import os
from pathlib import Path


def maskkv_home() -> Path:
    if os.environ.get("MASKKV_HOME"):
        return Path(os.environ["MASKKV_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "maskkv"


def config_file() -> Path:
    """The user's config file (TOML): ``MASKKV_CONFIG``, else ``~/.config/maskkv/config.toml``."""
    if os.environ.get("MASKKV_CONFIG"):
        return Path(os.environ["MASKKV_CONFIG"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "maskkv" / "config.toml"
