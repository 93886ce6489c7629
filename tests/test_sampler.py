from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from prompts import random_ids

import maskkv_cli.models.base as model_base
from maskkv_cli.engine.prefill import prefill
from maskkv_cli.engine.step import plain_logits
from maskkv_cli.errors import UsageError
from maskkv_cli.policies import get_policy
from maskkv_cli.sampling.common import Event, GenerationResult
from maskkv_cli.sampling.forward import CachedForward
from maskkv_cli.sampling.llada import GenerationConfig, generate, transfer_schedule


def test_transfer_schedule_rule():
    assert list(transfer_schedule(32, 8)) == [4] * 8
    assert list(transfer_schedule(10, 4)) == [3, 3, 2, 2]
    assert list(transfer_schedule(3, 5)) == [1, 1, 1, 0, 0]
    assert sum(transfer_schedule(37, 6)) == 37
    huge = transfer_schedule(8, 10**9)  # more steps than tokens: nothing is held per step
    assert len(huge) == 10**9 and huge[7] == 1 and huge[8] == huge[-1] == 0 and huge[:3] == [1, 1, 1]


def test_config_validation():
    with pytest.raises(UsageError, match="multiple of --block-length"):
        GenerationConfig(gen_length=30, block_length=8)
    with pytest.raises(UsageError, match="multiple of the number of blocks"):
        GenerationConfig(gen_length=32, block_length=8, steps=6)
    with pytest.raises(UsageError):
        GenerationConfig(threshold=1.5)


def test_step0_full_cache_equals_plain_forward(tiny_model):
    m, gen_len = 24, 16
    x = torch.cat([random_ids(tiny_model, m), torch.full((1, gen_len), tiny_model.config.mask_token_id)], 1)
    rows = torch.arange(m, m + gen_len)
    ref = plain_logits(tiny_model, x, rows)
    got, cache, _ = prefill(tiny_model, x, m, get_policy("full"), None, rows)
    # Same operations in the same order: equal up to fp32 rounding of the chunked MLP (none here).
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert torch.equal(tiny_model(x)[:, rows], ref)
    assert cache.logical_entries() == m * tiny_model.config.n_heads * tiny_model.config.n_layers


def test_later_steps_see_only_the_response(tiny_model, monkeypatch):
    m, gen_len = 24, 16
    seen: list[tuple[int, int]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape[2], k.shape[2]))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(model_base.F, "scaled_dot_product_attention", spy)
    gen = GenerationConfig(gen_length=gen_len, steps=4, block_length=gen_len)
    generate(tiny_model, random_ids(tiny_model, m), gen, get_policy("full"))
    n_layers = tiny_model.config.n_layers
    assert seen[:n_layers] == [(m + gen_len, m + gen_len)] * n_layers  # prefill: the whole sequence
    later = seen[n_layers:]
    assert len(later) == 3 * n_layers
    for q_len, k_len in later:
        assert k_len == m + gen_len  # kept prompt (all of it) + response keys
        assert q_len <= gen_len  # queries: the response only (the last layer only masked rows)


def test_deterministic_with_seed_and_temperature(tiny_model):
    gen = GenerationConfig(gen_length=16, steps=8, block_length=8, temperature=0.8, seed=3)
    a = generate(tiny_model, random_ids(tiny_model, 24), gen, get_policy("maskkv"), 8).tokens
    b = generate(tiny_model, random_ids(tiny_model, 24), gen, get_policy("maskkv"), 8).tokens
    c = generate(tiny_model, random_ids(tiny_model, 24), GenerationConfig(gen_length=16, steps=8, block_length=8,
                                                                        temperature=0.8, seed=4),
                 get_policy("maskkv"), 8).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("policy", ["none", "full", "maskkv"])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_commits_stay_and_follow_schedule(tiny_model, monkeypatch, policy, remasking):
    states: list[torch.Tensor] = []
    real_lane = CachedForward.lane

    def record(self, request):
        states.append(request.x[:1].clone())
        return real_lane(self, request)

    monkeypatch.setattr(CachedForward, "lane", record)
    events: list[Event] = []
    gen = GenerationConfig(gen_length=24, steps=12, block_length=8, remasking=remasking)
    out = generate(tiny_model, random_ids(tiny_model, 24), gen, get_policy(policy), 8, on_event=events.append)
    mask = tiny_model.config.mask_token_id
    final = torch.cat([states[-1][:, :24], out.tokens], 1)
    states.append(final)
    for before, after in zip(states[:-1], states[1:], strict=True):
        committed = before != mask
        assert torch.equal(before[committed], after[committed])
    steps = [e for e in events if e.kind in ("prefill", "step")]
    assert [e.committed for e in steps] == [2, 2, 2, 2] * 3  # 8 masks over 4 steps per block
    assert [e.block for e in steps] == [0] * 4 + [1] * 4 + [2] * 4
    assert not bool((out.tokens == mask).any())
    assert events[-1].kind == "done" and out.stats.steps_run == 12


def test_parallel_decoding_commits_at_least_one(tiny_model):
    events: list[Event] = []
    gen = GenerationConfig(gen_length=16, steps=2, block_length=8, threshold=0.99)
    out = generate(tiny_model, random_ids(tiny_model, 24), gen, get_policy("maskkv"), 8, on_event=events.append)
    steps = [e for e in events if e.kind != "done"]
    assert all(e.committed >= 1 for e in steps)
    assert sum(e.committed for e in steps) == 16
    assert not bool((out.tokens == tiny_model.config.mask_token_id).any())
    # threshold 0: everything above 0 is committed at once, one step per block
    events.clear()
    generate(tiny_model, random_ids(tiny_model, 24), GenerationConfig(gen_length=16, steps=2, block_length=8,
                                                                  threshold=0.0),
             get_policy("full"), on_event=events.append)
    assert [e.committed for e in events if e.kind != "done"] == [8, 8]


@pytest.mark.parametrize("policy", ["none", "full", "maskkv"])
def test_cfg_guides_with_a_prompt_masked_copy(tiny_model, policy):
    """Step 0 under guidance scale s commits the token and position that ``unc + (s + 1) * (cond - unc)`` picks,
    with ``unc`` the logits of the sequence whose prompt is all masks, computed here by hand; and guidance
    changes the answer of some prompts."""
    m, n, scale = 24, 8, 2.0
    mask_id = tiny_model.config.mask_token_id
    guided_gen = GenerationConfig(gen_length=n, steps=n, block_length=n, cfg_scale=scale)
    plain_gen = GenerationConfig(gen_length=n, steps=n, block_length=n)
    changed = 0
    for seed in range(4):
        ids = random_ids(tiny_model, m, seed)
        x = torch.cat([ids, torch.full((1, n), mask_id)], 1)
        un = x.clone()
        un[:, :m] = mask_id
        with torch.no_grad():
            cond, unc = tiny_model(x)[:, m:], tiny_model(un)[:, m:]
        logits = unc + (scale + 1) * (cond - unc)
        logits[..., mask_id] = float("-inf")
        conf, tokens = logits.double().softmax(-1).max(-1)
        first = int(conf[0].argmax())  # one token per step: step 0 commits the most confident position
        out = generate(tiny_model, ids, guided_gen, get_policy(policy), 8).tokens
        assert int(out[0, first]) == int(tokens[0, first])
        changed += not torch.equal(out, generate(tiny_model, ids, plain_gen, get_policy(policy), 8).tokens)
    assert changed > 0


def test_decode_strips_trailing_eos(tiny_tokenizer):
    from maskkv_cli.prompting import decode_answer

    eos = tiny_tokenizer.eos_token_id
    ids = tiny_tokenizer.encode("the river", add_special_tokens=False)
    assert decode_answer(tiny_tokenizer, ids + [eos] * 5, {eos}, 5) == "the river"


@pytest.mark.parametrize("threads", [1, 2])
def test_scratch_gives_the_reference_probabilities(threads):
    """The sampler's reused float64 memory (``sampling.common.Scratch``) changes no number: the chosen tokens'
    probabilities equal the reference expression for many rows (worked through a few at a time), for shrinking,
    growing and guided shapes and a vocabulary wider than one chunk, with one and two threads."""
    from maskkv_cli.sampling.picks import SCRATCH_BYTES, Scratch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        scratch = Scratch()
        wide = SCRATCH_BYTES // 8 + 5  # one row is more than a chunk
        for shape in ((1, 16, 5000), (1, 3, 5000), (2, 9, 5000), (1, 40, 7000), (1, 2, wide)):
            logits = torch.randn(shape, generator=g) * 4
            chosen = torch.randint(0, shape[-1], shape[:-1], generator=g)
            ref = logits.to(torch.float64).softmax(-1).gather(-1, chosen[..., None]).squeeze(-1)
            assert torch.equal(scratch.chosen_probabilities(logits, chosen), ref), shape
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("remasking,threshold", [("low_confidence", None), ("low_confidence", 0.5)])
def test_one_row_equals_each_row_of_two_copies(tiny_model, remasking, threshold):
    """A loop of one row skips the still-masked bookkeeping a batch of rows needs (every open position of one row is
    still a mask); a prompt of two identical rows runs the general path, and each of its rows must commit what the
    one row commits, step by step (random remasking draws for every row: not comparable)."""
    gen = GenerationConfig(gen_length=16, steps=8, block_length=8, remasking=remasking, threshold=threshold)
    prompt = random_ids(tiny_model, 24)
    for policy in ("none", "maskkv"):
        events: dict[int, list[torch.Tensor | None]] = {1: [], 2: []}
        outs: dict[int, GenerationResult] = {}
        for rows in (1, 2):
            seen = events[rows]
            outs[rows] = generate(tiny_model, prompt.expand(rows, -1).clone(), gen, get_policy(policy), 8,
                                  on_event=lambda e, seen=seen: seen.append(None if e.tokens is None
                                                                            else e.tokens.clone()))
        assert torch.equal(outs[2].tokens, outs[1].tokens.expand(2, -1)), policy
        assert torch.equal(outs[2].token_probs, outs[1].token_probs.expand(2, -1)), policy
        for one, two in zip(events[1], events[2], strict=True):
            assert (one is None) == (two is None) and (one is None or torch.equal(two, one.expand(2, -1)))
