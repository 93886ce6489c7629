"""Which model and policy a command uses when ``--model`` / ``--policy`` are not given, and the embedded demo model."""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path

from maskkv_cli.errors import UsageError
from maskkv_cli.paths import config_file, maskkv_home

# The policy of ask, summarize, generate, profile, demo and ``CacheConfig`` without --policy, and the reference of
# ``bench quality``'s task-by-task comparison: the paper's MaskKV as published, so that numbers compare with the
# paper's tables. Our variants (``maskkv-plus`` and others) are opt-in; docs/policies.md says why.
DEFAULT_POLICY = "maskkv"
# Entries per head per layer an evicting policy keeps when no --budget / --ratio is given.
DEFAULT_BUDGET = 256
# What --layer-budgets takes: the calibration profile if any (auto), measured on the input (online), uniform.
LAYER_BUDGET_CHOICES = ("auto", "online", "uniform")

TINY_RANDOM_NOTE = (
    "no --model given: using the embedded tiny RANDOM model (a demo of the pipeline; its answers are noise). "
    "Point --model (or MASKKV_MODEL) at a LLaDA-8B-Instruct folder for real answers."
)

_FALLBACK_TEXT = (
    "The river runs past the old mill and under the stone bridge. In the spring the water rises and the "
    "fields turn green. People in the village talk about the weather, the harvest and the trains that come "
    "twice a day. What is the special magic number for the river? The special magic number is 4821. "
)


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


def shipped_model() -> Path | None:
    """The trained tiny model shipped inside the package, when present."""
    folder = resources.files("maskkv_cli") / "assets" / "tiny-llada"
    path = Path(str(folder))
    return path if (path / "config.json").is_file() else None


def _corpus_text() -> list[str]:
    try:
        from maskkv_cli.documents.corpus import load_corpus

        paragraphs = load_corpus()
        if paragraphs:
            return paragraphs
    except (ImportError, OSError):
        pass
    return [_FALLBACK_TEXT] * 4


def tiny_random_model(folder: Path | None = None, seed: int = 0) -> Path:
    """Build (once) and return a tiny random LLaDA with a BPE tokenizer, saved in the real format."""
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.llada import LLaDA
    from maskkv_cli.models.loading import save_model
    from maskkv_cli.models.tokenizer_build import build_bpe_tokenizer

    folder = folder or maskkv_home() / "models" / "tiny-random"
    if (folder / "config.json").is_file():
        return folder
    tok = build_bpe_tokenizer(_corpus_text(), vocab_size=512)
    cfg = named_config("tiny").with_(vocab_size=len(tok))
    model = LLaDA(cfg).init_weights(seed)
    return save_model(model, folder, tok)


def resolve_default_model(model: str | None) -> tuple[str, str | None]:
    """(model path or id, a one-line note to show the user or None)."""
    if model:
        return model, None
    configured = configured_model()
    if configured:
        return configured, None
    shipped = shipped_model()
    if shipped is not None:
        return str(shipped), ("no --model given: using the embedded tiny LLaDA (trained here to find needle facts "
                              "in text and copy lead summaries; it cannot chat). For real answers: "
                              f"`{PULL_HINT}`, then --model {REAL_MODEL}.")
    return str(tiny_random_model()), TINY_RANDOM_NOTE
