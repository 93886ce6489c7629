"""MaskKV and the baselines on DiffusionGemma's prompt cache (issue #47, item 2; ``sampling/diffusion_gemma_kv.py``).

A tiny random DiffusionGemma of our own code (no transformers needed: its parity with transformers is
``tests/test_diffusion_gemma.py``): three sliding and three full layers alternating, 4 query heads, 2 KV heads of
16 dims on sliding layers and 2 of 32 on full layers (as the released model's full layers), window 8 under a
40-token prompt, canvas 8. Weights are random and deliberately sharp (as in ``test_diffusion_gemma.py``) so that
attention, and therefore the votes, are far from uniform."""

from __future__ import annotations

import pytest
import torch

from maskkv_cli.errors import UsageError
from maskkv_cli.kv.budgets import boundary_layer_budgets, pyramid_layer_budgets
from maskkv_cli.models.diffusion_gemma import DiffusionGemma, LayerKV, PromptCache
from maskkv_cli.models.diffusion_gemma_config import FULL, SLIDING, named_config
from maskkv_cli.policies import PolicyOptions, get_policy
from maskkv_cli.policies.baselines import snap_window
from maskkv_cli.sampling.diffusion_gemma_forward import CompressingForward, generate_compressed
from maskkv_cli.sampling.diffusion_gemma_kv import (
    compress,
    encode_prompt,
    first_step,
    first_step_compressing,
    full_layer_importance,
)
from maskkv_cli.sampling.diffusion_gemma_steps import DiffusionGemmaSampling, generate_reference, random_canvas

V, C, W, M = 512, 8, 8, 40
CFG = named_config("diffusiongemma-tiny").with_(n_layers=6, layer_types=(SLIDING, FULL) * 3, n_global_kv_heads=2)
FULL_LAYERS = CFG.full_layers  # (1, 3, 5)
SLIDING_LAYERS = (0, 2, 4)
DETERMINISTIC = dict(t_min=0.0, t_max=1e-6, max_denoising_steps=8)
BASELINES = ("snapkv", "pyramidkv", "adakv", "streamingllm")
IMPORTANCE = (0.1, 0.5, 0.2)  # per full layer


@pytest.fixture(scope="module")
def model() -> DiffusionGemma:
    torch.manual_seed(0)
    return DiffusionGemma(CFG).eval().init_spread_weights(0)


def _prompt(batch: int = 1, n: int = M, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def _canvas(batch: int = 1, seed: int = 2) -> torch.Tensor:
    return random_canvas(batch, C, V, torch.Generator().manual_seed(seed))


def _compress(model, name, budget, ids=None, canvas=None, **options):
    ids = _prompt() if ids is None else ids
    prompt = encode_prompt(model, ids)
    _, votes = first_step(model, prompt.cache, _canvas(ids.shape[0]) if canvas is None else canvas)
    return prompt, compress(model, prompt, votes, get_policy(name, PolicyOptions(**options)), budget)


def _kept_count(kv: LayerKV) -> torch.Tensor:
    if kv.kept is None:
        return torch.full(kv.keys.shape[:2], kv.keys.shape[2])
    return kv.kept.sum(-1)


# ----- no eviction: the full cache -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["full", "maskkv", *BASELINES])
def test_budget_at_least_the_prompt_is_the_full_cache(model, name):
    """Nothing evicted: the very cache, and the tokens of ``generate_reference`` for the same seed, in the
    deterministic limit and with the default (chaotic) sampler alike, two canvases, a batch of 2."""
    ids = _prompt(2)
    prompt, comp = _compress(model, name, M, ids, importance=IMPORTANCE)
    assert not comp.evicted and comp.cache is prompt.cache
    for settings in (DiffusionGemmaSampling(max_new_tokens=2 * C, **DETERMINISTIC),
                     DiffusionGemmaSampling(max_new_tokens=2 * C, max_denoising_steps=6)):
        ref = generate_reference(model, ids, settings, seed=3)
        out = generate_compressed(model, ids, get_policy(name, PolicyOptions(importance=IMPORTANCE)), M + 5,
                                  settings, seed=3)
        assert torch.equal(out.sequences, ref.sequences) and out.steps == ref.steps
        assert torch.equal(out.decoder_passes, ref.decoder_passes)


def test_full_never_evicts(model):
    """``full`` at any budget is the uncompressed cache: generate_reference's tokens in the deterministic limit."""
    ids = _prompt(1, seed=4)
    settings = DiffusionGemmaSampling(max_new_tokens=3 * C, **DETERMINISTIC)
    out = generate_compressed(model, ids, get_policy("full"), 4, settings, seed=0)
    assert not out.compression.evicted
    assert torch.equal(out.sequences, generate_reference(model, ids, settings, seed=0).sequences)


def test_a_kept_mask_of_every_slot_changes_nothing(model):
    """The masked attention path (``LayerKV.kept``) with every slot kept gives the unmasked logits."""
    cache = model.encode(_prompt()).cache
    masked = PromptCache(tuple(LayerKV(kv.keys, kv.values, torch.ones(kv.keys.shape[:3], dtype=torch.bool))
                               for kv in cache), cache.length)
    canvas = _canvas()
    assert (model.decode(canvas, masked) - model.decode(canvas, cache)).abs().max() < 1e-5


# ----- MaskKV at a small budget ----------------------------------------------------------------------------------

def test_maskkv_evicts_only_full_layers_and_each_head_keeps_its_budget(model):
    ids = _prompt(2)
    prompt, comp = _compress(model, "maskkv", 6, ids, importance=IMPORTANCE)
    assert comp.evicted and comp.cache.length == M
    for i in SLIDING_LAYERS:  # untouched: the latest W - 1 entries, exactly
        assert comp.cache.layers[i] is prompt.cache.layers[i] and comp.cache.layers[i].keys.shape[2] == W - 1
    assert [ch.layer for ch in comp.choices] == list(FULL_LAYERS)
    differ = False
    for ch in comp.choices:
        kv, full = comp.cache.layers[ch.layer], prompt.cache.layers[ch.layer]
        assert torch.equal(_kept_count(kv), ch.head_budgets)
        assert torch.equal(ch.head_budgets.sum(-1), torch.full((2,), 2 * ch.layer_budget))  # 2 KV heads
        assert kv.keys.shape[2] == int(ch.head_budgets.max()) < M
        differ |= bool((ch.head_budgets[:, 0] != ch.head_budgets[:, 1]).any())
        # every kept slot is the encoder's entry at its original position (RoPE kept), ascending
        for b in range(2):
            for h in range(2):
                n = int(ch.head_budgets[b, h])
                pos = ch.positions[b, h, :n]
                assert bool((pos[1:] > pos[:-1]).all())
                assert torch.equal(kv.keys[b, h, :n], full.keys[b, h, pos])
                assert torch.equal(kv.values[b, h, :n], full.values[b, h, pos])
    assert differ  # prompt preference gave the heads different budgets somewhere


def test_padding_slots_are_never_attended(model):
    """Garbage in every padding slot of the compressed layers leaves the logits (and a commit) as they are."""
    _, comp = _compress(model, "maskkv", 6, importance=IMPORTANCE)
    assert any(kv.kept is not None and not bool(kv.kept.all()) for kv in comp.cache.layers)
    garbage = []
    for kv in comp.cache.layers:
        if kv.kept is None:
            garbage.append(kv)
            continue
        pad = ~kv.kept[..., None]
        garbage.append(LayerKV(torch.where(pad, 1e3, kv.keys), torch.where(pad, -1e3, kv.values), kv.kept))
    dirty = PromptCache(tuple(garbage), comp.cache.length)
    canvas = _canvas(seed=9)
    assert torch.equal(model.decode(canvas, dirty), model.decode(canvas, comp.cache))
    tokens = _canvas(seed=10)
    a, b = model.commit(comp.cache, tokens), model.commit(dirty, tokens)
    for x, y in zip(a, b, strict=True):
        keep = torch.ones_like(x.keys[..., 0], dtype=torch.bool) if x.kept is None else x.kept
        assert torch.equal(x.keys[keep], y.keys[keep]) and torch.equal(x.values[keep], y.values[keep])


def test_layer_budgets_are_the_spec_allocation(model):
    """B = 6 over the 3 full layers, importance (0.1, 0.5, 0.2), beta 0.4, boundary = first and last full layer:
    k_p = 18, k_base = floor(0.4 * 18 / 3) = 2, k_imp = 12, boundary group 12 * 0.3 / 0.8 = 4.5, middle 7.5;
    boundary layers 2 + floor(2.25) = 4, the middle 2 + floor(7.5) = 9; the leftover unit to the most important
    layer (the middle): (4, 10, 4), total 18 = D_f * B."""
    _, comp = _compress(model, "maskkv", 6, importance=IMPORTANCE)
    assert comp.layer_budgets == (4, 10, 4) == tuple(boundary_layer_budgets(IMPORTANCE, 6, 0.4, max_budget=M))
    for budget in (4, 9, 16):
        _, comp = _compress(model, "maskkv", budget, importance=IMPORTANCE)
        assert sum(comp.layer_budgets) == 3 * budget
        assert comp.layer_budgets == tuple(boundary_layer_budgets(IMPORTANCE, budget, 0.4, max_budget=M))
    _, comp = _compress(model, "maskkv", 6)  # no importance: uniform, as the policy does elsewhere
    assert comp.layer_budgets == (6, 6, 6)
    with pytest.raises(UsageError, match="full-attention layers"):
        _compress(model, "maskkv", 6, importance=(0.1, 0.2))


def test_full_layer_importance(model):
    cache = model.encode(_prompt()).cache
    imp = full_layer_importance(model, cache, _canvas())
    assert len(imp) == 3 and all(0.0 <= x <= 2.0 for x in imp) and len(set(imp)) == 3
    _, comp = _compress(model, "maskkv", 6, importance=tuple(imp))
    assert sum(comp.layer_budgets) == 18


# ----- the baselines ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [*BASELINES, "random", "mask-vote-uniform"])
@pytest.mark.parametrize("budget", [4, 10])
def test_every_baseline_runs_and_keeps_its_budget(model, name, budget):
    ids = _prompt(2, seed=5)
    prompt, comp = _compress(model, name, budget, ids)
    assert comp.evicted and sum(comp.layer_budgets) == 3 * budget
    for i in SLIDING_LAYERS:
        assert comp.cache.layers[i] is prompt.cache.layers[i]
    for ch in comp.choices:
        assert torch.equal(_kept_count(comp.cache.layers[ch.layer]), ch.head_budgets)
        assert torch.equal(ch.head_budgets.sum(-1), torch.full((2,), 2 * ch.layer_budget))
        w = snap_window(budget if name == "pyramidkv" else ch.layer_budget, 32, M)  # PyramidKV: one W per run
        for b in range(2):
            for h in range(2):
                pos = ch.positions[b, h, : int(ch.head_budgets[b, h])].tolist()
                if name in ("snapkv", "pyramidkv", "adakv"):  # the observation window always stays
                    assert set(range(M - w, M)) <= set(pos)
                if name == "streamingllm":  # 4 sinks and the most recent entries
                    assert pos == [0, 1, 2, 3, *range(M - (ch.layer_budget - 4), M)]
    if name == "pyramidkv":
        w = snap_window(budget, 32, M)
        assert list(comp.layer_budgets) == pyramid_layer_budgets(3, budget, w, M, 20.0)
        assert comp.layer_budgets[0] >= comp.layer_budgets[1] >= comp.layer_budgets[2]
    # a generation over the compressed cache runs
    out = generate_compressed(model, ids, get_policy(name), budget,
                              DiffusionGemmaSampling(max_new_tokens=2 * C, **DETERMINISTIC), seed=1)
    assert out.sequences.shape == (2, M + 2 * C)


def test_adakv_heads_differ_snapkv_heads_equal(model):
    _, ada = _compress(model, "adakv", 10, _prompt(2, seed=5))
    _, snap = _compress(model, "snapkv", 10, _prompt(2, seed=5))
    assert any(bool((ch.head_budgets[:, 0] != ch.head_budgets[:, 1]).any()) for ch in ada.choices)
    assert all(bool((ch.head_budgets == 10).all()) for ch in snap.choices)


# ----- where the votes come from ---------------------------------------------------------------------------------

def test_votes_are_the_first_step_canvas_queries(model):
    """MaskKV keeps, per head, the prompt entries with the most attention from the first step's canvas queries
    (softmax over prompt and canvas keys, scale 1, averaged over the query heads of a KV head); another canvas
    changes the choice, while SnapKV (the encoder's last prompt queries) does not depend on the canvas."""
    ids = _prompt()
    prompt = encode_prompt(model, ids)
    canvas = _canvas(seed=2)
    _, votes = first_step(model, prompt.cache, canvas)
    _, comp = _compress(model, "mask-vote-uniform", 6, ids, canvas)
    for ch in comp.choices:
        q, k = votes[ch.layer]  # (1, 4, C, 32), (1, 2, M + C, 32)
        assert k.shape[2] == M + C
        probs = torch.softmax(q.float() @ k.float().repeat_interleave(2, dim=1).transpose(-1, -2), dim=-1)
        mass = probs.sum(2).view(1, 2, 2, M + C).mean(2)[..., :M]  # (1, H_kv, M)
        for h in range(2):
            assert set(ch.positions[0, h, :6].tolist()) == set(mass[0, h].topk(6).indices.tolist())

    def chosen(name, seed):
        _, c = _compress(model, name, 6, ids, _canvas(seed=seed), importance=IMPORTANCE)
        return [ch.positions.tolist() for ch in c.choices], c.layer_budgets, [ch.head_budgets.tolist() for ch in
                                                                              c.choices]

    assert chosen("maskkv", 2) != chosen("maskkv", 3)
    assert chosen("snapkv", 2) == chosen("snapkv", 3)
    assert chosen("streamingllm", 2) == chosen("streamingllm", 3)


def test_the_forward_votes_at_the_first_step_only(model):
    """CompressingForward encodes and compresses at its first decode (whose logits are the full cache's), and later
    decodes run over the compressed cache."""
    ids = _prompt()
    forward = CompressingForward(model, ids, get_policy("maskkv"), 6)
    full_cache = encode_prompt(model, ids).cache
    from maskkv_cli.sampling.diffusion_gemma_steps import DecodeRequest

    canvas = _canvas()
    logits = forward(DecodeRequest(canvas, None))
    assert torch.equal(logits, model.decode(canvas, full_cache))
    assert forward.compression is not None and forward.compression.evicted
    again = forward(DecodeRequest(canvas, None))
    assert torch.equal(again, model.decode(canvas, forward.compression.cache))
    assert not torch.equal(again, logits)


@pytest.mark.parametrize("name", ["maskkv", "snapkv", "pyramidkv", "adakv", "streamingllm"])
def test_layer_by_layer_equals_all_votes_then_compress(model, name):
    """Cutting each full layer as the first step reaches it (one layer's votes held) is ``first_step`` then
    ``compress``: the same logits, cache and choices."""
    ids, canvas = _prompt(2, seed=6), _canvas(2, seed=7)
    prompt, comp = _compress(model, name, 6, ids, canvas, importance=IMPORTANCE)
    logits, streamed = first_step_compressing(model, prompt, canvas,
                                              get_policy(name, PolicyOptions(importance=IMPORTANCE)), 6)
    assert torch.equal(logits, model.decode(canvas, prompt.cache))
    assert streamed.layer_budgets == comp.layer_budgets
    for a, b in zip(streamed.cache, comp.cache, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert (a.kept is None) == (b.kept is None) and (a.kept is None or torch.equal(a.kept, b.kept))
    for x, y in zip(streamed.choices, comp.choices, strict=True):
        assert torch.equal(x.positions, y.positions) and torch.equal(x.head_budgets, y.head_budgets)


def test_refused_policies(model):
    for name in ("prompt-vote", "all-vote"):
        with pytest.raises(UsageError, match="prompt queries"):
            _compress(model, name, 6)
    for name in ("maskkv-plus", "maskkv-residual"):
        with pytest.raises(UsageError, match="residual"):
            _compress(model, name, 6)
    with pytest.raises(UsageError, match="without a cache"):
        _compress(model, "none", 6)


# ----- later canvases ----------------------------------------------------------------------------------------------

def test_a_committed_canvas_joins_the_compressed_cache_exactly(model):
    """After a commit the full layers hold the kept prompt entries and all C new entries, positions go on from M
    (the first full layer's new keys equal the uncompressed commit's: its input comes from an exact sliding layer),
    and the next canvas attends to the committed entries."""
    ids = _prompt()
    prompt, comp = _compress(model, "maskkv", 6, importance=IMPORTANCE)
    tokens = _canvas(seed=11)
    after = model.commit(comp.cache, tokens)
    reference = model.commit(prompt.cache, tokens)
    assert after.length == M + C
    for ch in comp.choices:
        kv, before = after.layers[ch.layer], comp.cache.layers[ch.layer]
        assert kv.keys.shape[2] == before.keys.shape[2] + C
        assert kv.kept is not None and bool(kv.kept[..., -C:].all())
        assert torch.equal(kv.kept[..., :-C], before.kept)
        assert torch.equal(kv.keys[:, :, : before.keys.shape[2]], before.keys)
    first = FULL_LAYERS[0]
    assert (after.layers[first].keys[:, :, -C:] - reference.layers[first].keys[:, :, -C:]).abs().max() < 1e-5
    for i in SLIDING_LAYERS:  # sliding layers: the latest W - 1 entries, the committed canvas among them
        assert after.layers[i].keys.shape[2] == W - 1 and after.layers[i].kept is None
    # the next canvas sees the committed entries: hiding them on the full layers changes its logits
    hidden = list(after.layers)
    for i in FULL_LAYERS:
        kept = after.layers[i].kept.clone()
        kept[..., -C:] = False
        hidden[i] = LayerKV(after.layers[i].keys, after.layers[i].values, kept)
    canvas = _canvas(seed=12)
    assert not torch.allclose(model.decode(canvas, after), model.decode(canvas, PromptCache(tuple(hidden), M + C)))
    # the loop: three canvases over a compressed cache, the cache compressed once
    settings = DiffusionGemmaSampling(max_new_tokens=3 * C, **DETERMINISTIC)
    out = generate_compressed(model, ids, get_policy("maskkv", PolicyOptions(importance=IMPORTANCE)), 6, settings,
                              seed=2)
    assert out.sequences.shape == (1, M + 3 * C) and out.compression.layer_budgets == (4, 10, 4)
