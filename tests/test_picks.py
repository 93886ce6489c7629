"""The sampler step shared by a batch (sampling/picks.py): a rule run once over several lanes' rows gives each lane
the numbers it gets from its own logits alone, bit for bit."""

from __future__ import annotations

import pytest
import torch

from maskkv_cli.sampling.picks import MaskedArgmax, Pick, Scratch, SoftmaxMax, joined_span, pick_lanes, pick_one


@pytest.mark.parametrize("rule", [MaskedArgmax(5), SoftmaxMax()], ids=["llada", "llada2"])
@pytest.mark.parametrize(("vocab", "dtype"), [(2048, torch.float32), (126_464, torch.float32),
                                              (126_464, torch.bfloat16)])
@pytest.mark.parametrize("shapes", [[(1, 3), (2, 5), (1, 1), (3, 7), (1, 6)], [(1, 3), (1, 1), (1, 7), (1, 6)]],
                         ids=["mixed", "one-row"])
def test_a_joined_pick_equals_each_lanes_own(rule: Pick, vocab: int, dtype: torch.dtype,
                                             shapes: list[tuple[int, int]], threads: int) -> None:
    """Lanes of 1-3 sequences and 1-7 rows, joined as the engine joins them (one tensor split per lane; lanes of one
    sequence each are cut in one split); at 126k tokens the float64 scratch works 4 rows at a time, so joined and
    alone cut the rows at other places."""
    g = torch.Generator().manual_seed(vocab)
    sizes = [b * n for b, n in shapes]
    joined = (torch.randn(1, sum(sizes), vocab, generator=g) * 4).to(dtype)
    joined[0, 3, 5] = 1e4  # (lane 1's first row) the mask token's logit would win: LLaDA's rule never picks it
    parts = [p.reshape(*shape, vocab) for p, shape in zip(joined.split(sizes, 1), shapes, strict=True)]
    alone = [pick_one(rule, p.clone(), Scratch()) for p in parts]
    together = pick_lanes(rule, joined_span(parts), sizes, shapes, Scratch())  # type: ignore[arg-type]
    for a, t, shape in zip(alone, together, shapes, strict=True):
        assert t.tokens.shape == shape and t.probs.shape == shape
        assert torch.equal(a.tokens, t.tokens) and torch.equal(a.probs, t.probs)
    if isinstance(rule, MaskedArgmax):
        assert together[1].tokens[0, 0] != 5 and together[0].probs.dtype == torch.float64
    else:
        assert together[0].probs.dtype == torch.float32


def test_joined_span_only_for_rows_back_to_back() -> None:
    joined = torch.randn(1, 10, 16)
    parts = [p.reshape(1, -1, 16) for p in joined.split([4, 6], 1)]
    span = joined_span(parts)
    assert span is not None and span.shape == (10, 16) and span.data_ptr() == joined.data_ptr()
    assert torch.equal(span, joined[0])
    assert joined_span([parts[1], parts[0]]) is None  # out of order
    assert joined_span([parts[0], torch.randn(1, 6, 16)]) is None  # another tensor
    assert joined_span([joined[:, :4], joined[:, 5:]]) is None  # a gap
    assert joined_span([joined[:, :, :8]]) is None  # not contiguous rows
