"""Random prompt ids for the engine and sampler tests, and the list of policies that evict."""

from __future__ import annotations

import torch

from maskkv_cli.policies import policy_names

EVICTING = [p for p in policy_names() if p not in ("none", "full")]  # every policy with a budget


def random_ids(model: torch.nn.Module, n: int = 40, seed: int = 0) -> torch.Tensor:
    """(1, n) token ids drawn uniformly from the model's vocabulary above its special tokens (ids 0-5)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, model.config.vocab_size, (1, n), generator=g)
