"""The commit step shared by a batch (``sampling/commits.py``): joined commits write what each commits alone."""

from __future__ import annotations

import pytest
import torch

import maskkv_cli.sampling.commits as commits
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.policies.base import get_policy
from maskkv_cli.sampling.commits import TopCommit, commit_together, share_slab
from maskkv_cli.sampling.common import Denoising


def test_a_top_k_over_rows_ranks_each_row_as_that_row_alone() -> None:
    """The joined commit's premise on the CPU: ``topk`` over the rows of a (G, n) tensor gives each row the indices
    and values its own ``topk`` gives, ties (common: probabilities of exactly 1.0) and -inf included."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        g = int(torch.randint(2, 9, (), generator=gen))
        n = int(torch.randint(1, 200, (), generator=gen))
        k = int(torch.randint(1, n + 1, (), generator=gen))
        conf = torch.randint(0, 3, (g, n), generator=gen).double() / 2  # many exact ties
        if trial % 3 == 0:
            conf[:, ::2] = float("-inf")
        joined = conf.topk(k, dim=1)
        for row in range(g):
            alone = conf[row].topk(k)
            assert torch.equal(joined.indices[row], alone.indices) and torch.equal(joined.values[row], alone.values)


def _runs(model, lengths: list[int], gen_length: int) -> list[Denoising]:  # type: ignore[no-untyped-def]
    runs = []
    for i, m in enumerate(lengths):
        prompt = torch.randint(6, model.config.vocab_size, (1, m), generator=torch.Generator().manual_seed(i))
        plan = CachePlan.build(model, get_policy("full"), None, m)
        runs.append(Denoising(model, prompt, gen_length, 0, plan, None, gen_length))
    return runs


def _commit(run: Denoising, n: int, k: int, seed: int) -> TopCommit:
    gen = torch.Generator().manual_seed(seed)
    masked = (run.x[0, run.m :] == run.mask_id).nonzero().flatten()  # open positions are still-masked ones
    rows = masked[torch.randperm(len(masked), generator=gen)[:n]].sort().values
    conf = torch.randint(0, 4, (1, n), generator=gen).double() / 3  # ties
    x0 = torch.randint(6, 60, (1, n), generator=gen)
    return TopCommit(rows, conf, None, [k], x0, conf.clone(), 0.0, 0, 1)


def test_joined_commits_write_what_each_commits_alone(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Generations in one slab whose commits choose as many of as many positions are written in one pass; the others
    (another count, no slab) alone; every sequence and token probability ends as ``commit_top`` alone leaves it."""
    joined: list[int] = []
    real = commits._commit_joined

    def counted(group, k):  # type: ignore[no-untyped-def]
        joined.append(len(group))
        return real(group, k)

    monkeypatch.setattr(commits, "_commit_joined", counted)
    lengths = [5, 9, 7, 12, 6]
    shared, alone = _runs(tiny_model, lengths, 16), _runs(tiny_model, lengths, 16)
    share_slab(shared[:4])  # the fifth joined the stream on its own
    assert all(run.slab is shared[0].slab for run in shared[:4]) and shared[4].slab is None
    assert all(torch.equal(a.x, b.x) for a, b in zip(shared, alone, strict=True))  # moved, not changed
    for step in range(3):
        picks = [_commit(run, 10 - 2 * step, 3 if i != 2 else 2, 10 * step + i) for i, run in enumerate(shared)]
        done = commit_together(list(zip(shared, picks, strict=True)))
        assert [error for error, _ in done] == [None] * len(shared)
        for i, (run, pick) in enumerate(zip(alone, picks, strict=True)):
            pick.run_alone(run)
            left = done[i][1]
            if i in (2, 4):  # run alone: their loops find their open positions themselves
                assert left is None
            else:  # sent: the open positions the loop would find in its sequence
                assert left is not None
                assert torch.equal(left, pick.rows[run.x[0, run.m + pick.rows] == run.mask_id])
    assert joined == [3, 3, 3]  # the slab's runs of count 3; the count-2 one and the one outside alone
    for a, b in zip(shared, alone, strict=True):
        assert torch.equal(a.x, b.x)
        assert torch.equal(a.token_probs.isnan(), b.token_probs.isnan())
        assert torch.equal(a.token_probs.nan_to_num(), b.token_probs.nan_to_num())
        assert a.meter.steps == b.meter.steps == 3
