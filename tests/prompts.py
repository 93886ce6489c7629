"""Shared test data: the tiny tokenizer's training texts, random prompt ids, the list of policies that evict."""

from __future__ import annotations

import torch

from maskkv_cli.policies import policy_names

TEXTS = [
    "The river runs past the old mill and under the stone bridge. In spring the water rises. ",
    "What is the special magic number for apple? The special magic number for apple is 48213. ",
    "Trains come twice a day. People talk about the weather, the harvest and the market. ",
    "Bees fly from flower to flower; the library opens at nine and closes at five. ",
] * 8  # the tiny BPE tokenizer of the test models (conftest.py, golden_cases.py) is trained on these
# A short document for the embedded model's ``ask`` (three copies of one needle among filler): what a user's
# first try looks like, and an answer it gives with high confidence.
NEEDLE_PARAGRAPH = ("The river runs past the old mill and under the stone bridge. In the spring the water rises. "
                    "The special magic number for apple is 4821. People talk about the weather and the harvest. ")
NEEDLE_DOC = NEEDLE_PARAGRAPH * 3
EVICTING = [p for p in policy_names() if p not in ("none", "full")]  # every policy with a budget


def random_ids(model: torch.nn.Module, n: int = 40, seed: int = 0) -> torch.Tensor:
    """(1, n) token ids drawn uniformly from the model's vocabulary above its special tokens (ids 0-5)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, model.config.vocab_size, (1, n), generator=g)
