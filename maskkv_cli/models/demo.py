"""The random demo model: a tiny LLaDA with random weights and a BPE tokenizer, built (once) when no trained model
ships with the package, so that every command still runs end to end."""

from __future__ import annotations

from pathlib import Path

from maskkv_cli.paths import maskkv_home

__all__ = ["tiny_random_model"]

# Text for the tokenizer when the package corpus cannot be read.
_FALLBACK_TEXT = (
    "The river runs past the old mill and under the stone bridge. In the spring the water rises and the "
    "fields turn green. People in the village talk about the weather, the harvest and the trains that come "
    "twice a day. What is the special magic number for the river? The special magic number is 4821. "
)


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
