"""Layer importance ``I(l)`` for MaskKV's boundary-aware layer budgets, measured over calibration inputs.

``I(l) = 1 - mean cos(h_in, h_out)`` over every token of every calibration input, where ``h_in`` is the
hidden state entering layer l's attention sub-layer and ``h_out = h_in + attention output`` (before the
MLP), in fp32 (spec section 2, "Layer level"). ``maskkv calibrate`` stores the result as a calibration profile
(``maskkv_cli.policies.calibration``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from maskkv_cli.engine.forward import MLP_CHUNK, attention_shift
from maskkv_cli.errors import UsageError
from maskkv_cli.models.protocol import DiffusionLM

__all__ = ["ImportanceResult", "calibration_inputs", "layer_importance", "measure_importance"]


@dataclass(frozen=True)
class ImportanceResult:
    importance: list[float]  # I(l) per layer, in [0, 2]
    inputs: int  # sequences measured
    tokens: int  # tokens the mean runs over


@torch.no_grad()
def measure_importance(
    model: DiffusionLM,
    batches: Iterable[Tensor],
    on_batch: Callable[[int, int], None] | None = None,
    mlp_chunk: int = MLP_CHUNK,
) -> ImportanceResult:
    """``I(l)`` over ``batches`` of token ids, each (B, T) or (T,); every token of every input weighs the same.

    The blocks run piece by piece (``qkv``, SDPA, ``attn_proj``, ``mlp``) exactly as in the prefill, so the
    values match the online measurement of ``prefill(..., online_importance=True)`` on the same input.
    ``on_batch(inputs_done, tokens_done)`` is called after each batch (progress displays).
    """
    n_layers = len(model.blocks)
    sums = torch.zeros(n_layers, dtype=torch.float64, device=model.device)
    inputs = tokens = 0
    for ids in batches:
        if ids.dim() == 1:
            ids = ids[None]
        ids = ids.to(model.device)
        b, t = ids.shape
        if t == 0:
            continue
        x = model.embed(ids)
        cos, sin = model.rope(torch.arange(t, device=ids.device))
        for i, block in enumerate(model.blocks):
            q, k, v = block.qkv(x, cos, sin)
            attn = block.attn_proj(F.scaled_dot_product_attention(q, k, v))
            del q, k, v
            sums[i] += attention_shift(x, attn)
            if i == n_layers - 1:
                break  # the last MLP does not change any I(l)
            x = x + attn
            del attn
            x = x + block.mlp(x, mlp_chunk)
        inputs += b
        tokens += b * t
        if on_batch is not None:
            on_batch(inputs, tokens)
    if tokens == 0:
        raise UsageError("no calibration input: give at least one non-empty text")
    return ImportanceResult([float(s) / tokens for s in sums.tolist()], inputs, tokens)


def layer_importance(model: DiffusionLM, batches: Iterable[Tensor]) -> list[float]:
    """``I(l) = 1 - mean cos(h_in, h_out)`` per layer over all tokens of ``batches`` (see the module doc)."""
    return measure_importance(model, batches).importance


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
    from maskkv_cli.prompting import chat_prompt_ids

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
