"""DiffusionGemma on long prompts (issue #47): the chunked encoder, the full layers' cache growing in place, the
bounded attention masks, and memory linear in the prompt.

A tiny random DiffusionGemma of our own code (its parity with transformers is ``tests/test_diffusion_gemma.py``,
which runs the same encoder on prompts of one chunk). Memory is read as live tensor bytes (``bench/live_bytes.py``:
exact, the allocator aside; a kernel's own scratch is not seen)."""

from __future__ import annotations

import pytest
import torch

import maskkv_cli.models.diffusion_gemma as dgemma
import maskkv_cli.models.diffusion_gemma_attention as attention
from maskkv_cli.bench.live_bytes import LiveBytes
from maskkv_cli.models.diffusion_gemma import DiffusionGemma, LayerKV, PromptCache
from maskkv_cli.models.diffusion_gemma_attention import attend, attend_causal
from maskkv_cli.models.diffusion_gemma_cache import resident_bytes
from maskkv_cli.models.diffusion_gemma_config import FULL, SLIDING, named_config
from maskkv_cli.models.rows import small_rows
from maskkv_cli.policies import get_policy
from maskkv_cli.sampling.diffusion_gemma_kv import compress, encode_prompt, first_step
from maskkv_cli.sampling.diffusion_gemma_steps import random_canvas

V, C, W = 512, 8, 8
CFG = named_config("diffusiongemma-tiny").with_(n_layers=6, layer_types=(SLIDING, FULL) * 3, n_global_kv_heads=2,
                                                max_position_embeddings=1 << 16)
FULL_LAYERS = CFG.full_layers


@pytest.fixture(scope="module")
def model() -> DiffusionGemma:
    torch.manual_seed(0)
    return DiffusionGemma(CFG).eval().init_spread_weights(0)


def _ids(n: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def _close(a: PromptCache, b: PromptCache, tol: float = 1e-5) -> None:
    assert a.length == b.length
    for x, y in zip(a, b, strict=True):
        assert x.keys.shape == y.keys.shape
        assert float((x.keys - y.keys).abs().max()) <= tol and float((x.values - y.values).abs().max()) <= tol


# ----- the same numbers in any chunks --------------------------------------------------------------------------------

@torch.no_grad()
def test_chunks_and_mask_blocks_give_the_one_pass_cache(model, monkeypatch):
    """A 45-token prompt (window 8) in one chunk, in chunks of 7, and in chunks of 7 with masks of at most 30
    entries (blocks of a row or two): the same cache and hidden states within 1e-5; the sliding layers keep their
    latest W - 1 entries, the full layers every one."""
    ids = _ids(45, batch=2)
    whole = model.encode(ids, hidden_states=True)
    chunked = model.encode(ids, hidden_states=True, chunk=7)
    monkeypatch.setattr(attention, "MASK_ELEMENTS", 30)
    blocked = model.encode(ids, hidden_states=True, chunk=7)
    for out in (chunked, blocked):
        _close(out.cache, whole.cache)
        for a, b in zip(out.hidden_states, whole.hidden_states, strict=True):
            assert (a - b).abs().max() < 1e-5 * b.abs().max()
    assert [kv.length for kv in whole.cache] == [W - 1, 45] * 3


@torch.no_grad()
def test_a_canvas_joins_a_compressed_cache_the_same_in_chunks(model):
    """The encoder over a compressed cache (kept slots per head, padding never attended) gives the same entries
    whether the committed canvas runs as one chunk or in chunks of 3."""
    prompt = encode_prompt(model, _ids(40, seed=2))
    canvas = random_canvas(1, C, V, torch.Generator().manual_seed(3))
    _, votes = first_step(model, prompt.cache, canvas)
    cut = compress(model, prompt, votes, get_policy("maskkv"), 6).cache
    assert any(cut.layers[i].kept is not None for i in FULL_LAYERS)
    tokens = random_canvas(1, C, V, torch.Generator().manual_seed(4))
    one, three = model.encode(tokens, cut).cache, model.encode(tokens, cut, chunk=3).cache
    _close(three, one)
    for i in FULL_LAYERS:
        assert torch.equal(three.layers[i].kept, one.layers[i].kept)


@pytest.mark.parametrize("mask_kind", ["none", "shared", "per query head", "per KV head", "per KV head and row"])
def test_folding_the_groups_into_rows_is_the_grouped_attention(mask_kind):
    """``attend`` with each KV head's query heads folded into its rows (what it does on CUDA) equals SDPA's grouped
    heads (what it does on the CPU), for every mask layout the model passes."""
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, r, s, d = 2, 8, 2, 5, 11, 16
    q, k, v = torch.randn(b, h, r, d, generator=gen), torch.randn(b, hkv, s, d, generator=gen), \
        torch.randn(b, hkv, s, d, generator=gen)
    masks = {"none": None, "shared": torch.rand(r, s, generator=gen) > 0.3,
             "per query head": torch.rand(b, h, 1, s, generator=gen) > 0.3,
             "per KV head": torch.rand(b, hkv, 1, s, generator=gen) > 0.3,
             "per KV head and row": torch.rand(b, hkv, r, s, generator=gen) > 0.3}
    mask = masks[mask_kind]
    if mask is not None:
        mask[..., 0] = True  # every row sees a key
    grouped, folded = attend(q, k, v, mask, fold=False), attend(q, k, v, mask, fold=True)
    assert folded.shape == grouped.shape == (b, h, r, d)
    assert (folded - grouped).abs().max() < 1e-5


def test_causal_blocks_see_their_slots_only():
    """``attend_causal`` over slots [cache ; rows] in blocks of one row equals one masked SDPA call, with a window
    and with kept slots; a value planted in a slot a row must not see changes nothing."""
    gen = torch.Generator().manual_seed(1)
    b, h, hkv, first, r, d = 1, 4, 2, 6, 5, 8
    q, k, v = torch.randn(b, h, r, d, generator=gen), torch.randn(b, hkv, first + r, d, generator=gen), \
        torch.randn(b, hkv, first + r, d, generator=gen)
    kept = torch.rand(b, hkv, first + r, generator=gen) > 0.3
    kept[..., first:] = True
    for window, slots in ((None, None), (4, None), (None, kept)):
        at = torch.arange(first, first + r)[:, None]
        visible = torch.arange(first + r)[None, :] <= at
        if window is not None:
            visible &= torch.arange(first + r)[None, :] > at - window
        mask = visible if slots is None else visible[None, None] & slots[:, :, None]
        one = attend(q, k, v, mask)
        blocks = attend_causal(q, k, v, first, window, slots, mask_elements=1)
        assert (blocks - one).abs().max() < 1e-6
    poisoned = v.clone()
    poisoned[:, :, first + 1 :] = 1e6  # the slots after the first row: row 0 never sees them
    assert (attend_causal(q, k, poisoned, first)[:, :, 0] - attend_causal(q, k, v, first)[:, :, 0]).abs().max() == 0


# ----- the full layers' store ----------------------------------------------------------------------------------------

@torch.no_grad()
def test_the_cache_grows_in_place_and_a_second_continuation_copies(model):
    """A prompt encoded with room: a committed canvas is written into the same store (no copy); a second canvas
    committed to the same prompt cache copies into a store of its own, and the first continuation is unchanged; the
    decoder's canvas uses the room as scratch, leaving the cache as it was."""
    prompt = model.encode(_ids(30), spare=2 * C).cache
    first_tokens, other_tokens = (random_canvas(1, C, V, torch.Generator().manual_seed(s)) for s in (5, 6))
    one = model.commit(prompt, first_tokens)
    i = FULL_LAYERS[0]
    assert one.layers[i].store is prompt.layers[i].store  # in place
    saved = [kv.keys.clone() for kv in one]
    two = model.commit(prompt, other_tokens)  # a fork of the prompt cache: its own store
    assert two.layers[i].store is not prompt.layers[i].store
    assert all(torch.equal(kv.keys, k) for kv, k in zip(one, saved, strict=True))
    _close(one, model.commit(model.encode(_ids(30)).cache, first_tokens), tol=0)  # the same numbers as a copy's
    logits = model.decode(random_canvas(1, C, V, torch.Generator().manual_seed(7)), one)
    assert all(torch.equal(kv.keys, k) for kv, k in zip(one, saved, strict=True))
    plain = PromptCache(tuple(LayerKV(kv.keys.clone(), kv.values.clone()) for kv in one), one.length)
    assert torch.equal(logits, model.decode(random_canvas(1, C, V, torch.Generator().manual_seed(7)), plain))


# ----- memory linear in the prompt -----------------------------------------------------------------------------------

def _encoder_peaks(model: DiffusionGemma, lengths: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(live peak of encoding, the cache's bytes, live peak of one decoder pass over it) per prompt length."""
    small_rows("cpu", model.dtype)  # the once-per-process probe of models/rows.py, not the encoder's
    out = []
    for m in lengths:
        with torch.no_grad(), LiveBytes() as live:
            cache = model.encode(_ids(m, seed=m), spare=CFG.canvas_length).cache
        with torch.no_grad(), LiveBytes() as step:
            model.decode(random_canvas(1, CFG.canvas_length, V, torch.Generator().manual_seed(0)), cache)
        out.append((live.peak, resident_bytes(cache), step.peak))
        del cache
    return out


def test_encoder_and_decoder_memory_are_linear_in_the_prompt(model, monkeypatch):
    """Prompts of 1,024, 2,048 and 4,096 tokens in chunks of 256: the encoder's peak grows by about the same bytes
    per token at each doubling (the cache and one chunk's masks over the prompt; one pass over the whole prompt,
    with its T x T masks, grows four times faster); with masks bounded below the prompt its activations above the
    cache do not grow at all. A decoder pass over a cache with room copies none of it: its peak is the same at
    every length."""
    monkeypatch.setattr(dgemma, "ENCODER_CHUNK", 256)
    (p1, c1, d1), (p2, c2, d2), (p4, c4, d4) = _encoder_peaks(model, (1024, 2048, 4096))
    assert c1 < c2 < c4 and p4 > p2 > p1
    assert (p4 - p2) <= 2.2 * (p2 - p1)  # linear: 2 per doubling; quadratic: 4
    assert p4 - c4 <= 256 * 4096 * 6 + (p1 - c1)  # above the cache: one chunk's masks (bool + fp32) and the rest
    assert d1 == d2 == d4
    monkeypatch.setattr(attention, "MASK_ELEMENTS", 256 * 512)  # blocks of 128 rows at 1,024 tokens, 32 at 4,096
    (p1, c1, _), (p4, c4, _) = _encoder_peaks(model, (1024, 4096))
    assert p4 - c4 <= 1.1 * (p1 - c1)


@torch.no_grad()
def test_policy_none_re_encodes_in_the_cached_runs_chunks(model, monkeypatch):
    """Chunks of 16 under a 45-token prompt whose document ends at 23 (so both parts cross a chunk edge), two
    canvases: ``none`` (everything encoded again before each decoder pass, in the same chunks) gives the tokens of
    ``full`` and of MaskKV at a budget above the prompt, exactly."""
    from maskkv_cli.engine.plan import CachePlan
    from maskkv_cli.sampling import GenerationConfig, sample

    monkeypatch.setattr(dgemma, "ENCODER_CHUNK", 16)
    prompt = _ids(45, seed=9)
    gen = GenerationConfig(gen_length=2 * C, steps=2 * C, block_length=2 * C, seed=3)
    tokens = {}
    for name, budget in (("none", None), ("full", None), ("maskkv", 100)):
        plan = CachePlan.build(model, get_policy(name), budget, 45, document_len=23)
        tokens[name] = sample(model, prompt, gen, plan).tokens
    assert tokens["none"].shape == (1, 2 * C)
    assert torch.equal(tokens["none"], tokens["full"]) and torch.equal(tokens["full"], tokens["maskkv"])


# ----- layer by layer, the first step's cut interleaved ------------------------------------------------------------

@pytest.mark.parametrize("how", ["one part", "split", "prefix"])
@pytest.mark.parametrize("name", ["maskkv", "snapkv", "streamingllm"])
@torch.no_grad()
def test_layer_by_layer_with_the_cut_is_encoding_then_cutting(model, monkeypatch, name, how):
    """Chunks of 16 under a 45-token prompt (a document of 23 encoded as its own part, or before as a prefix): the
    prompt encoded layer by layer, each full layer cut by the first step's votes before the next is encoded, gives
    the first step's logits, the cut cache and the choices of encoding it whole then cutting, to the bit."""
    from maskkv_cli.sampling.diffusion_gemma_forward import encode_and_cut, encode_whole
    from maskkv_cli.sampling.diffusion_gemma_kv import first_step_compressing

    monkeypatch.setattr(dgemma, "ENCODER_CHUNK", 16)
    ids, canvas = _ids(45, seed=12), random_canvas(1, C, V, torch.Generator().manual_seed(13))
    policy = get_policy(name)
    window = policy.options.window
    prefix = encode_prompt(model, ids[:, :23], window) if how == "prefix" else None
    split = 23 if how == "split" else 0
    logits, whole = first_step_compressing(model, encode_whole(model, ids, window, prefix, split), canvas, policy, 6)
    layered_logits, layered = encode_and_cut(model, ids, canvas, policy, 6, prefix, split)
    assert torch.equal(layered_logits, logits)
    assert layered.layer_budgets == whole.layer_budgets and layered.cache.length == 45
    for a, b in zip(layered.cache, whole.cache, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert (a.kept is None and b.kept is None) or torch.equal(a.kept, b.kept)
    for a, b in zip(layered.choices, whole.choices, strict=True):
        assert a.layer == b.layer and torch.equal(a.positions, b.positions)
        assert torch.equal(a.head_budgets, b.head_budgets)


@torch.no_grad()
def test_layer_by_layer_never_holds_the_whole_cache(model, monkeypatch):
    """A 4,096-token prompt (chunks of 256, masks bounded below the prompt so that they do not decide the peak),
    MaskKV at 64: encoding layer by layer with the cut holds the prompt's hidden states and one whole full layer
    where encoding it whole holds all three full layers, so its peak is lower by two full layers less the hidden
    states (within 10%)."""
    from maskkv_cli.sampling.diffusion_gemma_forward import encode_and_cut, encode_whole
    from maskkv_cli.sampling.diffusion_gemma_kv import first_step_compressing

    monkeypatch.setattr(dgemma, "ENCODER_CHUNK", 256)
    monkeypatch.setattr(attention, "MASK_ELEMENTS", 1 << 16)
    small_rows("cpu", model.dtype)
    m, policy = 4096, get_policy("maskkv")
    ids, canvas = _ids(m, seed=14), random_canvas(1, C, V, torch.Generator().manual_seed(15))
    with LiveBytes() as whole:
        encoded = encode_whole(model, ids, policy.options.window, spare=C)
        whole_logits, _ = first_step_compressing(model, encoded, canvas, policy, 64)
        del encoded
    with LiveBytes() as layered:
        layered_logits, _ = encode_and_cut(model, ids, canvas, policy, 64)
    assert torch.equal(layered_logits, whole_logits)
    one_layer = 2 * CFG.layer(FULL_LAYERS[0]).n_kv_heads * CFG.layer(FULL_LAYERS[0]).head_dim * 4 * (m + C)
    hidden = m * CFG.d_model * 4
    saved = (len(FULL_LAYERS) - 1) * one_layer - hidden
    assert abs((whole.peak - layered.peak) - saved) <= 0.1 * saved
