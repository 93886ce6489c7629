"""The commit step shared by a batch: each generation's most confident still-masked positions written, one pass for
the generations whose sequences share one storage.

A bidirectional loop (``llada.py``, ``dream.py``) that commits the ``counts`` most confident of its open positions
yields a ``TopCommit`` once it has its step's picks, instead of writing them itself, and the driver
(``sampling/driver.py``) runs every commit of the round together (``commit_together``). Generations that join a
stream together keep their sequences and token probabilities in one ``Slab`` (``share_slab``). Their commits of
one row each that choose as many of as many open positions run as one: a top-k over their stacked confidences (on
the CPU a top-k over rows ranks each row exactly as the row alone, ties included; elsewhere each row's own top-k),
then one ``index_put_`` for every chosen token and one for every probability, and each loop is sent the positions
still masked after it (those it would find in its sequence, found for all of them at once). Any other commit runs
on its own (``Denoising.commit_top``) and its loop finds them itself. Either way each position gets the token and
probability it gets alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from maskkv_cli.sampling.common import Denoising, Slab


@dataclass(frozen=True)
class TopCommit:
    """A loop's step, picked and ranked, to commit: ``Denoising.commit_top``'s arguments (the ``counts[b]`` most
    confident still-masked of the open positions ``rows`` of each row, ``conf`` -inf where no longer a mask)."""

    rows: Tensor
    conf: Tensor
    still: Tensor | None
    counts: list[int]
    x0: Tensor
    chosen_prob: Tensor
    t0: float
    block: int
    n_blocks: int

    def run_alone(self, run: Denoising) -> None:
        run.commit_top(self.rows, self.conf, self.still, self.counts, self.x0, self.chosen_prob, self.t0,
                       self.block, self.n_blocks)


def share_slab(runs: Sequence[object]) -> None:
    """Move the sequences of the one-row ``Denoising`` runs among ``runs`` (generations joining a stream together,
    not started yet) into one ``Slab`` per device (and dtypes), so that their commits can run together."""
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[Denoising]] = {}
    for run in runs:
        if isinstance(run, Denoising) and run.x.shape[0] == 1 and run.slab is None:
            groups.setdefault((run.x.device, run.x.dtype, run.token_probs.dtype), []).append(run)
    for (device, tokens_dtype, probs_dtype), group in groups.items():
        if len(group) < 2:
            continue
        slab = Slab(torch.empty(sum(r.x.numel() for r in group), dtype=tokens_dtype, device=device),
                    torch.empty(sum(r.token_probs.numel() for r in group), dtype=probs_dtype, device=device))
        start = probs_start = 0
        for run in group:
            run.adopt(slab, start, probs_start)
            start += run.x.numel()
            probs_start += run.token_probs.numel()


def _joined_key(run: object, commit: TopCommit) -> tuple[int, int, int] | None:
    """What commits must share to run as one (slab, open positions, count), None for a commit that runs alone."""
    if not isinstance(run, Denoising) or run.slab is None or commit.still is not None or commit.x0.shape[0] != 1:
        return None
    n = commit.conf.shape[1]
    k = min(commit.counts[0], n)
    if k == 0 or commit.x0.dtype != run.slab.tokens.dtype or commit.chosen_prob.dtype != run.slab.probs.dtype:
        return None
    return id(run.slab), n, k


def commit_together(commits: Sequence[tuple[object, TopCommit]]) -> list[tuple[BaseException | None, Tensor | None]]:
    """Run every ``(run, commit)`` (see the module doc); per commit the error that ended it (or None) and, for a
    commit run with others, the open positions still masked after it (None: the loop finds them in its sequence)."""
    errors: list[BaseException | None] = [None] * len(commits)
    left: list[Tensor | None] = [None] * len(commits)
    groups: dict[tuple[int, int, int], list[int]] = {}
    alone: list[int] = []
    for i, (run, commit) in enumerate(commits):
        key = _joined_key(run, commit)
        (alone if key is None else groups.setdefault(key, [])).append(i)
    for key, members in groups.items():
        if len(members) == 1:
            alone.extend(members)
            continue
        try:
            still = _commit_joined([commits[i] for i in members], key[2])  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - a failed joined write ends the generations in it
            for i in members:
                errors[i] = exc
            continue
        for i, rows in zip(members, still, strict=True):
            left[i] = rows
        for i in members:  # each step's end: its timing and its listener's event (which may end it alone)
            run, commit = commits[i]
            try:
                assert isinstance(run, Denoising)
                run.meter.step(commit.t0, run.x, key[2], commit.block, commit.n_blocks)
            except Exception as exc:  # noqa: BLE001
                errors[i] = exc
    for i in sorted(alone):
        run, commit = commits[i]
        try:
            assert isinstance(run, Denoising)
            commit.run_alone(run)
        except Exception as exc:  # noqa: BLE001 - the generation's own failure
            errors[i] = exc
    return list(zip(errors, left, strict=True))


def _commit_joined(commits: list[tuple[Denoising, TopCommit]], k: int) -> list[Tensor | None]:
    """The ``k`` most confident of each one-row commit's open positions (as many for each), written in one pass (the
    steps' ends are the caller's); each one's open positions still masked after it (all None where a chosen token is
    the mask token itself, which a greedy rule never picks: the loops then look for themselves)."""
    left = commit_rows([run for run, _ in commits], torch.stack([c.rows for _, c in commits]),
                       torch.cat([c.conf for _, c in commits]), torch.cat([c.x0 for _, c in commits]),
                       torch.cat([c.chosen_prob for _, c in commits]), k)
    return [None] * len(commits) if left is None else list(left.unbind(0))


def slab_offsets(runs: Sequence[Denoising]) -> tuple[Tensor, Tensor]:
    """Where each one-row run's response and token probabilities start in their slab: (G, 1) each."""
    slab = runs[0].slab
    assert slab is not None
    device = slab.tokens.device
    first = slab.tokens.storage_offset()
    tokens_at = torch.tensor([r.x.storage_offset() - first + r.m for r in runs], device=device)[:, None]
    first = slab.probs.storage_offset()
    probs_at = torch.tensor([r.token_probs.storage_offset() - first for r in runs], device=device)[:, None]
    return tokens_at, probs_at


def commit_rows(runs: Sequence[Denoising], rows: Tensor, conf: Tensor, x0: Tensor, chosen_prob: Tensor,
                k: int, offsets: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
    """Commit the ``k`` most confident of the open positions ``rows`` (G, n) of each of the one-row ``runs`` (one
    slab), by ``conf`` (G, n), with their tokens ``x0`` and probabilities ``chosen_prob`` (G, n), in one write of
    each: on the CPU one top-k over the rows (which ranks each row exactly as the row alone, ties included), elsewhere
    each row's own. ``offsets``: the runs' ``slab_offsets``, where the caller keeps them. Returns each run's open
    positions still masked after it (G, n - k), ascending as ``rows`` are; None where a chosen token is the mask
    token itself (a greedy rule never picks it): the loops look for themselves."""
    slab = runs[0].slab
    assert slab is not None
    if conf.device.type == "cpu":
        chosen = conf.topk(k, dim=1).indices
    else:
        chosen = torch.stack([row.topk(k).indices for row in conf])
    at = rows.gather(1, chosen)  # (G, k)
    tokens_at, probs_at = slab_offsets(runs) if offsets is None else offsets
    tokens = x0.gather(1, chosen)
    slab.tokens.index_put_(((at + tokens_at).view(-1),), tokens.view(-1))
    probs = chosen_prob.gather(1, chosen)
    slab.probs.index_put_(((at + probs_at).view(-1),), probs.view(-1))
    mask_id = runs[0].mask_id
    if any(r.mask_id != mask_id for r in runs):
        return None
    still = torch.ones_like(rows, dtype=torch.bool).scatter_(1, chosen, tokens == mask_id)
    left = rows[still]
    if left.numel() != rows.shape[0] * (rows.shape[1] - k):
        return None
    return left.view(rows.shape[0], -1)
