"""MaskKV (and the baselines) on DiffusionGemma's prompt cache (the loop over it: ``diffusion_gemma_forward.py``).

DiffusionGemma (``models/diffusion_gemma.py``) has no mask token: its canvas starts as uniform-random ids and the
first denoising step has no self-conditioning signal. **Our reading** of mask-query voting for such a model: the
voters are the decoder's queries of the *first step of the first canvas* (the random initial canvas, zero
self-conditioning), attending over ``[cached prompt keys ; canvas keys]`` of each full-attention layer with the
softmax over all of them (scale 1, as the model attends). Random ids are not masks; whether their queries vote as
well as LLaDA's mask queries is a question for the real checkpoint, not settled here.

What is compressed (``compress``):

- only the **full-attention** layers (D_f of them: 5 in the released model, 2 KV heads each). Sliding-window layers
  already hold at most W - 1 entries, all of which the canvas sees; they stay exact;
- the budget B is the average number of prompt entries kept per KV head per full layer (the spec's convention over
  the D_f evictable layers): ``policy.layer_budgets(D_f, B, M)`` gives each full layer its budget (MaskKV: the
  boundary-aware split over the full layers, their first and last as the boundary group, from ``importance``
  given per full layer, e.g. averaged ``full_layer_importance`` over a calibration set; without it uniform, as the
  policy does elsewhere), ``policy.head_budgets`` splits it over the layer's KV heads (MaskKV: prompt preference;
  AdaKV: its layer-wide top-k) and ``kv.cache.select_layer`` keeps each head's best entries, in position order;
- per-head budgets differ, so a layer's heads are padded to its longest head and ``LayerKV.kept`` (B, H_kv, K) says
  which slots are entries: the model's attention never reads a False slot (a boolean SDPA mask), so each head
  attends exactly to its own kept set. With equal budgets no mask is stored;
- positions are carried by ``PromptCache.length`` (unchanged by eviction); keys keep the RoPE of their original
  positions;
- a budget at least the prompt (or a policy that does not evict, ``full``) compresses nothing: the same cache.

The baselines' observation windows: SnapKV, PyramidKV and AdaKV vote with the prompt's last W queries. DiffusionGemma
reads its prompt with a **causal encoder**, so those queries are the encoder's queries of the last W prompt
positions on each full layer, each seeing the prompt keys up to its own position (causal inside the window, as in
SnapKV's autoregressive original; no canvas key), collected while the prompt is encoded (``encode_prompt``).
StreamingLLM keeps the first 4 entries and the most recent ones; ``random`` is uniform. Ablations that vote with
every prompt query (``prompt-vote``, ``all-vote``) are refused (only the last ``window`` encoder queries are kept),
and so are policies with residual entries (``maskkv-plus``, ``maskkv-residual``: not ported to this cache).

The loop and the forward that answers its requests over the compressed cache are
``sampling/diffusion_gemma_forward.py`` (which also encodes the prompt layer by layer with the first step's cut
interleaved).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from maskkv_cli.errors import UsageError
from maskkv_cli.kv.cache import select_layer
from maskkv_cli.models.diffusion_gemma import DiffusionGemma, LayerKV, PromptCache, attend, entry_mask
from maskkv_cli.policies.base import LayerView, Policy

SCALE = 1.0  # DiffusionGemma's softmax scale (QK-norm replaces 1 / sqrt(D))


# ----- the votes -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EncodedPrompt:
    """The encoder's prompt cache and, per full layer, the rotated queries of the last prompt positions (B, H, w, D)
    (the baselines' observation window)."""

    cache: PromptCache
    window_queries: dict[int, Tensor]


class WindowQueries:
    """The baselines' observation window while a prompt is encoded: each full layer's rotated queries of the last
    ``window`` positions seen so far (``observe`` is a ``LayerObserver``: the encoder shows one chunk at a time),
    after a ``prefix``'s own."""

    def __init__(self, model: DiffusionGemma, window: int, prefix: EncodedPrompt | None = None) -> None:
        self.full, self.window = set(model.gemma.full_layers), window
        self.queries: dict[int, Tensor] = {} if prefix is None or not window else {
            i: prefix.window_queries[i][:, :, -window:] for i in self.full}

    def observe(self, i: int, _x: Tensor, q: Tensor, _k: Tensor, _v: Tensor) -> None:
        if i in self.full and self.window:
            both = q if i not in self.queries else torch.cat((self.queries[i], q), dim=2)
            self.queries[i] = both[:, :, -self.window :].clone()


@torch.no_grad()
def encode_prompt(model: DiffusionGemma, ids: Tensor, window: int = 32,
                  prefix: EncodedPrompt | None = None, spare: int = 0) -> EncodedPrompt:
    """Encode the prompt ids (B, M), keeping each full layer's queries of the last ``min(window, M)`` positions.

    ``prefix``: the prompt's leading ids encoded before (``encode_prompt`` of ``ids[:, :p]`` with the same
    ``window``, e.g. a document's, computed once for all its questions): only the rest is encoded, over its cache,
    which is the prompt encoded in these two parts; the window takes the prefix's last queries when the rest is
    shorter than it (a query depends on the ids up to itself only). ``spare``: room the full layers keep after the
    prompt (``DiffusionGemma.encode``)."""
    start = 0 if prefix is None else prefix.cache.length
    if prefix is not None and (start > ids.shape[1] or prefix.cache.batch_size != ids.shape[0]):
        raise ValueError(f"a prefix of {start} positions does not start this {tuple(ids.shape)} prompt")
    recent = WindowQueries(model, min(window, ids.shape[1]), prefix)
    cache = prefix.cache if prefix is not None else None
    if ids.shape[1] > start:
        cache = model.encode(ids[:, start:], cache, observe=recent.observe, spare=spare).cache
    assert cache is not None
    return EncodedPrompt(cache, recent.queries)


Votes = dict[int, tuple[Tensor, Tensor]]  # full layer -> (canvas queries, keys over [prompt ; canvas])


@torch.no_grad()
def first_step(model: DiffusionGemma, cache: PromptCache, canvas: Tensor) -> tuple[Tensor, Votes]:
    """The first denoising step over the full cache (no self-conditioning): its raw logits (B, C, V) and, per full
    layer, the canvas queries (B, H, C, D) and the keys they attend to, ``[prompt ; canvas]`` (B, H_kv, M + C, D)."""
    full = set(model.gemma.full_layers)
    seen: Votes = {}

    def observe(i: int, _x: Tensor, q: Tensor, k: Tensor, _v: Tensor) -> None:
        if i in full:
            seen[i] = (q, k)

    return model.decode(canvas, cache, observe=observe), seen


@torch.no_grad()
def full_layer_importance(model: DiffusionGemma, cache: PromptCache, canvas: Tensor) -> list[float]:
    """I(l) = 1 - mean over canvas tokens of cos(h_in, h_out) of each full layer's attention sub-layer (the residual
    stream before and after adding attention) at the first denoising step of ``canvas`` over ``cache``: MaskKV's
    layer importance, one value per full layer in order. Average it over a calibration set for the offline
    budgets."""
    full = model.gemma.full_layers
    values: dict[int, float] = {}

    def observe(i: int, x: Tensor, q: Tensor, k: Tensor, v: Tensor) -> None:
        if i not in full:
            return
        layer = model.layers[i]
        cached = cache.layers[i]
        mask = entry_mask(cached.kept, q.shape[2], q.shape[1])
        h = x + layer.post_attention_layernorm(layer.self_attn.out(attend(q, k, v, mask)))
        values[i] = 1.0 - float(F.cosine_similarity(x.float(), h.float(), dim=-1).mean())

    model.decode(canvas, cache, observe=observe)
    return [values[i] for i in full]


def _visible(prompt_len: int, total: int, device: torch.device) -> Callable[[int, int], Tensor]:
    """``LayerView.visible`` over ``[prompt ; canvas]``: which keys the queries of rows [start, stop) see."""

    def visible(start: int, stop: int) -> Tensor:
        rows = torch.arange(start, stop, device=device)[:, None]  # (R, 1) query positions
        keys = torch.arange(total, device=device)[None, :]  # (1, M + C): prompt, then canvas
        prompt_row = rows < prompt_len
        # a prompt (encoder) query sees the prompt up to itself; a canvas query sees everything
        return torch.where(prompt_row, keys <= rows, torch.ones_like(keys, dtype=torch.bool))

    return visible


def layer_view(index: int, n_full: int, canvas_q: Tensor, keys: Tensor, prompt_len: int,
               window_q: Tensor | None) -> LayerView:
    """The policies' view of one full layer: queries and keys over ``[prompt ; canvas]`` (M + C positions). The
    canvas rows are the first step's canvas queries (``mask_mass``: the votes), the last ``w`` prompt rows the
    encoder's window queries (causal); other prompt rows are not kept and are refused."""
    b, h, c, d = canvas_q.shape
    total = prompt_len + c
    w = 0 if window_q is None else window_q.shape[2]

    def compute_q(start: int, stop: int) -> Tensor:
        if start >= prompt_len:
            return canvas_q[:, :, start - prompt_len : stop - prompt_len]
        if window_q is not None and start >= prompt_len - w and stop <= prompt_len:
            first = prompt_len - w
            return window_q[:, :, start - first : stop - first]
        raise UsageError(f"DiffusionGemma compression keeps the canvas queries and the last {w} prompt queries; "
                         f"this policy asks for prompt queries {start}..{stop - 1} (the prompt-vote / all-vote "
                         "ablations are not supported on this model)")

    q = torch.empty(b, h, total, d, dtype=canvas_q.dtype, device="meta")
    return LayerView(index, n_full, q, keys, prompt_len, SCALE, compute_q=compute_q, mask_start=prompt_len,
                     visible=_visible(prompt_len, total, keys.device))


# ----- compression ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerChoice:
    """What the policy kept on one full layer (CPU tensors)."""

    layer: int  # the model's layer index
    layer_budget: int
    head_budgets: Tensor  # (B, H_kv) entries kept per KV head
    positions: Tensor  # (B, H_kv, K) kept prompt positions ascending; past a head's budget: padding
    preference: Tensor | None  # (B, H_kv) P_h when the policy computes it


@dataclass(frozen=True)
class Compression:
    cache: PromptCache
    choices: tuple[LayerChoice, ...]  # one per full layer; empty when nothing was evicted
    layer_budgets: tuple[int, ...] | None  # per full layer; None when nothing was evicted

    @property
    def evicted(self) -> bool:
        return self.layer_budgets is not None


def check_policy(policy: Policy) -> None:
    if policy.residual_spread > 0:
        raise UsageError(f"policy {policy.name!r} adds residual entries, which DiffusionGemma's compressed cache does "
                         "not support yet; use maskkv, a baseline or full")
    if not policy.uses_cache:
        raise UsageError(f"policy {policy.name!r} recomputes without a cache; DiffusionGemma always caches its "
                         "prompt (its encoder is causal, so 'full' is exact)")


def planned_budgets(model: DiffusionGemma, prompt_len: int, policy: Policy, budget: int) -> list[int] | None:
    """The budget of each full layer (in order) at ``budget`` entries per KV head on average over a prompt of
    ``prompt_len`` tokens, or None when nothing is evicted (a policy that keeps everything, a budget at least the
    prompt, no full layer). They depend on the prompt length alone (MaskKV's importance is given, offline), so each
    layer can be cut as soon as it is scored, before the next one is even encoded."""
    check_policy(policy)
    full = model.gemma.full_layers
    if not policy.evicts or budget >= prompt_len or not full:
        return None
    importance = policy.options.importance
    if policy.uses_importance and importance is not None and len(importance) != len(full):
        raise UsageError(f"{policy.name}: {len(importance)} layer importances for {len(full)} full-attention layers "
                         "(DiffusionGemma's budgets are over its full layers)")
    return policy.layer_budgets(len(full), budget, prompt_len)


def layer_budgets(model: DiffusionGemma, prompt: EncodedPrompt, policy: Policy, budget: int) -> list[int] | None:
    """``planned_budgets`` for an encoded prompt, whose full layers must hold the prompt alone."""
    budgets = planned_budgets(model, prompt.cache.length, policy, budget)
    if budgets is not None:
        for i in model.gemma.full_layers:
            kv = prompt.cache.layers[i]
            if kv.kept is not None or kv.keys.shape[2] != prompt.cache.length:
                raise ValueError("compress takes the encoder's cache of the prompt alone (nothing compressed or "
                                 "committed after it)")
    return budgets


def select_full_layer(model: DiffusionGemma, prompt: EncodedPrompt, policy: Policy, j: int, layer_budget: int,
                      canvas_q: Tensor, keys: Tensor) -> tuple[LayerKV, LayerChoice]:
    """Full layer number ``j`` (of the full layers, in order) cut to the policy's choice: its scores and head
    budgets from the votes (canvas queries (B, H, C, D), keys ``[prompt ; canvas]``), each head's best entries
    kept in position order (``kv.cache.select_layer``), padded to the longest head under ``LayerKV.kept``."""
    full = model.gemma.full_layers
    i, m = full[j], prompt.cache.length
    kv = prompt.cache.layers[i]
    view = layer_view(j, len(full), canvas_q, keys, m, prompt.window_queries.get(i))
    scores = policy.scores(view, layer_budget)
    heads = policy.head_budgets(view, layer_budget, scores)
    chosen = select_layer(kv.keys, kv.values, scores, heads, m, 0, model.gemma.n_heads // kv.keys.shape[1])
    kept = torch.arange(chosen.prompt_slots, device=kv.keys.device)[None, None, :] < chosen.lengths[..., None]
    pref = policy.preference(view)
    assert chosen.positions is not None
    choice = LayerChoice(i, layer_budget, chosen.lengths.cpu(), chosen.positions.cpu(),
                         None if pref is None else pref.cpu())
    return LayerKV(chosen.k, chosen.v, None if bool(kept.all()) else kept), choice


def compress(model: DiffusionGemma, prompt: EncodedPrompt, votes: Votes, policy: Policy,
             budget: int) -> Compression:
    """The prompt cache with each full layer cut to the policy's choice at ``budget`` entries per KV head on average
    (see the module doc); ``votes`` from ``first_step`` over ``prompt.cache`` (``first_step_compressing`` does the
    same a layer at a time, without keeping every layer's votes)."""
    budgets = layer_budgets(model, prompt, policy, budget)
    if budgets is None:
        return Compression(prompt.cache, (), None)
    layers = list(prompt.cache.layers)
    choices = []
    for j, (i, lb) in enumerate(zip(model.gemma.full_layers, budgets, strict=True)):
        layers[i], choice = select_full_layer(model, prompt, policy, j, lb, *votes[i])
        choices.append(choice)
    return Compression(PromptCache(tuple(layers), prompt.cache.length), tuple(choices), tuple(budgets))


@torch.no_grad()
def first_step_compressing(model: DiffusionGemma, prompt: EncodedPrompt, canvas: Tensor, policy: Policy,
                           budget: int) -> tuple[Tensor, Compression]:
    """The first denoising step over the full cache (its raw logits, exact) and the compression its votes give,
    each full layer scored and cut as the step reaches it (its votes are dropped right after): the result of
    ``first_step`` then ``compress``, holding one layer's votes at a time."""
    budgets = layer_budgets(model, prompt, policy, budget)
    if budgets is None:
        return model.decode(canvas, prompt.cache), Compression(prompt.cache, (), None)
    full = model.gemma.full_layers
    layers = list(prompt.cache.layers)
    choices: list[LayerChoice] = []

    def observe(i: int, _x: Tensor, q: Tensor, k: Tensor, _v: Tensor) -> None:
        if i in full:
            j = full.index(i)
            layers[i], choice = select_full_layer(model, prompt, policy, j, budgets[j], q, k)
            choices.append(choice)

    logits = model.decode(canvas, prompt.cache, observe=observe)
    return logits, Compression(PromptCache(tuple(layers), prompt.cache.length), tuple(choices), tuple(budgets))


__all__ = ["Compression", "EncodedPrompt", "LayerChoice", "WindowQueries", "check_policy", "compress", "encode_prompt",
           "first_step", "first_step_compressing", "full_layer_importance", "layer_budgets", "layer_view",
           "planned_budgets", "select_full_layer"]
