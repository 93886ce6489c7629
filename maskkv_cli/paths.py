"""Where maskkv keeps its files (``MASKKV_HOME``, default: the per-user cache folder; the config file) and where a
model is: a checkpoint folder, or a Hugging Face id in the local HF cache (never downloaded here)."""

from __future__ import annotations

import os
from pathlib import Path

from maskkv_cli.errors import ModelLoadError, ModelNotDownloaded

# files of a model folder that hold its tokenizer's vocabulary (tokenizer_config.json alone names a class only)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


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


def shipped_model_folder() -> Path | None:
    """The trained tiny model shipped inside the package (``assets/tiny-llada``), when present; found without
    importing any model code (``ingest`` counts tokens with its tokenizer)."""
    from importlib import resources

    path = Path(str(resources.files("maskkv_cli") / "assets" / "tiny-llada"))
    return path if (path / "config.json").is_file() else None


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, found as huggingface_hub finds it: ``HF_HUB_CACHE`` (or the older
    ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``, else the XDG cache's; ``~`` and ``$VAR`` in them expanded."""
    def expanded(value: str) -> str:
        return os.path.expandvars(os.path.expanduser(value))

    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(expanded(cache))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
    )
    return Path(expanded(home)) / "hub"


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A local folder, or ``org/name`` found in the local Hugging Face cache (never downloaded)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder {path} has no config.json; point --model at a checkpoint folder")
        return path
    if path.exists():
        raise ModelLoadError(f"--model must be a checkpoint folder, {path} is a file")
    text = str(name_or_path)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        repo = hf_cache_dir() / ("models--" + text.replace("/", "--"))
        snapshots = repo / "snapshots"
        if snapshots.is_dir():
            ref = repo / "refs" / "main"
            if ref.is_file():
                candidate = snapshots / ref.read_text().strip()
                if (candidate / "config.json").is_file():
                    return candidate
            found = sorted(
                (p for p in snapshots.iterdir() if (p / "config.json").is_file()),
                key=lambda p: p.stat().st_mtime,
            )
            if found:
                return found[-1]
        raise ModelNotDownloaded(text, repo)
    raise ModelLoadError(f"model folder {path} does not exist")
