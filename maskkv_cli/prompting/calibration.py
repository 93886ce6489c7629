"""Calibration inputs for ``maskkv calibrate``: windows of a text in the chat template, followed by masks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from maskkv_cli.errors import UsageError
from maskkv_cli.prompting.chat import chat_prompt_ids


def calibration_inputs(
    tokenizer: Any,
    texts: Sequence[str],
    max_tokens: int,
    samples: int,
    gen_length: int,
    mask_id: int,
) -> list[list[int]]:
    """Calibration sequences shaped like real inputs: chat template around a document window, then masks.

    The texts are tokenized and joined (blank line between them), cut into windows of ``max_tokens`` tokens, and
    at most ``samples`` windows are taken, spread evenly over the whole text. A trailing window shorter than a
    quarter of ``max_tokens`` is dropped unless it is the only one. Each window is wrapped in the chat template
    as the user's message and ``gen_length`` mask ids are appended.
    """
    if max_tokens < 1 or samples < 1 or gen_length < 0:
        raise UsageError("--max-tokens and --samples must be positive and --gen-length not negative")
    ids: list[int] = []
    separator = list(tokenizer.encode("\n\n", add_special_tokens=False))
    for text in texts:
        if not text.strip():
            continue
        if ids:
            ids.extend(separator)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise UsageError("the calibration text is empty")
    windows = [ids[i : i + max_tokens] for i in range(0, len(ids), max_tokens)]
    if len(windows) > 1 and len(windows[-1]) < max(1, max_tokens // 4):
        windows.pop()
    if len(windows) > samples:
        windows = [windows[len(windows) * j // samples] for j in range(samples)]
    return [chat_prompt_ids(tokenizer, tokenizer.decode(w)) + [mask_id] * gen_length for w in windows]
