"""Whether running prompts together can pay (``--batch-size auto``): the share of their work a batch shares.

A batch gains by reading each weight once for the rows of all its sequences, so it gains on passes whose time is
the weights' read: the denoising steps over a cache (a few rows each) and prefills short enough to be joined
(``engine.prefill.join_rows``). A longer prompt's prefill runs on its own in a batch as alone (its rows already
keep the cores busy), and so does a step of the ``none`` policy (the whole prompt again): a batch cannot speed them
up. In the one such shape measured (``docs/scale.md``: prompts of 1,380-1,700 tokens, 8 steps of 8 rows, the
embedded model) a batch cost 8-17% per job under glibc's default allocator thresholds, and gained 7-10% at batch 8
once they were fixed at 4 MiB (``runtime/allocator.py``).

The share is counted in rows through the model (a prompt's prefill: its tokens; a step: the rows it runs), per
prompt, summed over the run's prompts. It cannot say by itself how much a batch gains: a step of many rows already
shares each weight among its own rows and gains less from a batch, and longer answers raise the share with
longer steps. Measured on the embedded model at one thread (``docs/scale.md``, batch 8 against 1): a share of 1.0
(70-token prompts joined, steps of 8 rows) gained 1.87x; 0.40 (1,380-1,700-token prompts, 32 steps of 32 rows)
1.02x, where ``auto`` at the memory model's 16 was 0.97x; 0.04 (the same prompts, 8 steps of 8 rows) lost 10%
then, and gained 1.07-1.10x after the allocator change. So ``auto`` runs prompts together only where nearly all of
the work is shared (``MIN_SHARED``), which keeps it at least as fast as one at a time on every shape measured, and
forgoes what a batch might gain in between. Rows are not time: on a GPU a step's time is the weights' read, which a
batch shares, so there the rule likely forgoes more for long documents (not measured: no GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_SHARED = 0.9  # the least share of shared rows for which ``auto`` runs prompts together


@dataclass(frozen=True)
class BatchWork:
    """Rows a run's prompts put through the model, and how many of them a batch shares."""

    rows: int
    shared_rows: int
    unjoined: int  # prompts whose prefill is longer than the joined rows
    join_rows: int
    cached: bool  # the steps run over a cache (else each runs the prompt again)

    @property
    def share(self) -> float:
        return self.shared_rows / self.rows if self.rows else 1.0

    @property
    def pays(self) -> bool:
        return self.share >= MIN_SHARED

    def reason(self) -> str:
        """Why a batch does not pay, in words."""
        why = (f"{self.unjoined} of their prefills are longer than the {self.join_rows} rows joined and run alone"
               if self.cached else f"without a cache every step runs the prompt again, alone past "
                                   f"{self.join_rows} rows")
        return f"a batch shares {self.share:.0%} of these prompts' work, under {MIN_SHARED:.0%}: {why}"


def batch_work(prompt_lens: Sequence[int], steps: int, step_rows: int, cached: bool, join_rows: int) -> BatchWork:
    """The rows of ``prompt_lens`` prompts, each prefilled and then denoised in ``steps`` steps of ``step_rows``
    rows over its cache (``cached``; else every step runs the prompt again with them)."""
    rows = shared = unjoined = 0
    for length in prompt_lens:
        joined = length <= join_rows
        unjoined += not joined
        step = step_rows if cached else length + step_rows
        step_shared = cached or length + step_rows <= join_rows
        rows += length + steps * step
        shared += length * joined + steps * step * step_shared
    return BatchWork(rows, shared, unjoined, join_rows, cached)
