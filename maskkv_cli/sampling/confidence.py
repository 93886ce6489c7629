"""How sure the model was of an answer: the probability of each answer token at the step it was unmasked.

The samplers record, for every response position, the probability the model gave the committed token at the
step it was committed (``GenerationResult.token_probs``). An answer's confidence is the mean and the minimum
of those probabilities over its own tokens (up to the first end-of-text token). When the statistic
``LOW_CONFIDENCE_STATISTIC`` (the mean or the minimum) is below ``LOW_CONFIDENCE`` the CLI marks the answer as a
likely guess (``cli/render.py`` words it); the rule that chose both, and its evidence, are in ``docs/models.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The statistic ("mean" or "min" token probability) and the cut under which an answer is shown as
# low-confidence. Chosen on one sample of needle tasks with the embedded model and confirmed on a second sample
# fixed in advance (docs/models.md, scripts/confidence_threshold.py); re-chosen by the same rule whenever the
# embedded model changes (stage 24: the minimum, 0.95).
LOW_CONFIDENCE_STATISTIC = "min"
LOW_CONFIDENCE = 0.95


@dataclass(frozen=True)
class Confidence:
    mean: float
    min: float
    tokens: int

    @property
    def low(self) -> bool:
        return (self.mean if LOW_CONFIDENCE_STATISTIC == "mean" else self.min) < LOW_CONFIDENCE

    def as_dict(self) -> dict[str, Any]:
        return {"mean": round(self.mean, 4), "min": round(self.min, 4), "tokens": self.tokens, "low": self.low,
                "threshold": LOW_CONFIDENCE, "statistic": LOW_CONFIDENCE_STATISTIC}


def answer_confidence(ids: Sequence[int], probs: Sequence[float], stops: set[int],
                      mask_id: int) -> Confidence | None:
    """Mean and minimum committed probability of the answer's tokens (those before the first stop token);
    None when the answer has no tokens."""
    kept: list[float] = []
    for token, p in zip(ids, probs, strict=True):
        if token in stops:
            break
        if token != mask_id and not math.isnan(p):
            kept.append(float(p))
    if not kept:
        return None
    return Confidence(sum(kept) / len(kept), min(kept), len(kept))
