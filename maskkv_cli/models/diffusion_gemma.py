"""DiffusionGemma's text model (``model_type: diffusion_gemma``): one set of Gemma-4 MoE layers used twice.

- The **encoder** (``DiffusionGemma.encode``) is a causal pass over prompt ids, like an autoregressive prefill: it
  returns each layer's keys (post-norm, post-RoPE) and values as the decoder consumes them (``PromptCache``).
  Sliding layers see a window of W tokens (themselves and W - 1 before) and keep only the latest W - 1 entries,
  as transformers' dynamic sliding-window cache does; full layers keep every position.
- The **decoder** (``DiffusionGemma.decode``) runs on one canvas of ``canvas_length`` tokens at the positions after
  the cache; every canvas query attends bidirectionally over [cached prompt K/V ; canvas K/V] and the cache is
  never written. Its input is the canvas embedding plus a self-conditioning signal made from the previous
  step's logits (nothing at the first step), RMS-normalised.
- A finished canvas joins the cache by running its tokens through the encoder (``commit``).

The layer (spec section 3): Gemma's RMSNorm (fp32, times the weight, no "+1"); attention with RMS-normalised q
and k per head, softmax scale 1, GQA; sliding layers have a value projection whose output is RMS-normalised
without a weight, full layers none (their values are the raw key projection, normalised the same way and not
rotated); RoPE per layer kind (``inverse_frequencies``); then a dense gated-GELU MLP and a mixture of experts in
parallel on the attention output (the router reads the un-normalised stream), each with its own norms, summed,
normalised, added, and the whole stream times the layer's scalar. The encoder and the decoder have separate
layer scalars (buffers transformers does not tie); every weight is shared. The head is the tied embedding, with
logits soft-capped in fp32.

Parameter names are the checkpoint keys transformers writes (``model.decoder.embed_tokens.weight``,
``model.decoder.layers.{i}.self_attn.q_proj.weight``, ``...experts.gate_up_proj``,
``model.decoder.self_conditioning.gate_proj.weight``, ...) except the encoder's layer scalar, kept beside the
decoder's as ``model.decoder.layers.{i}.encoder_layer_scalar`` (checkpoint
``model.encoder.language_model.layers.{i}.layer_scalar``); ``checkpoint_key`` maps it. Loading:
``models.loading.load_diffusion_gemma`` (``load_model`` of its folder).

The model is not built on ``models.base.DiffusionModel``: the engine's layer-streamed prefill and response steps do
not run it. Its generations run through ``sampling/diffusion_gemma.py`` (in the one driver, each alone), and prompt
KV compression (a policy's kept entries per full layer and head, ``LayerKV.kept``) is
``sampling/diffusion_gemma_kv.py``; ``encode`` and ``decode`` honour it and can show each layer's queries and keys
to an observer (its votes). The encoder runs in chunks of ``ENCODER_CHUNK`` rows and writes the full layers' entries
in place (``models/diffusion_gemma_cache.py``), and attention is masked in bounded blocks
(``models/diffusion_gemma_attention.py``), so encoding and decoding take memory linear in the prompt. Quantized
weights: ``quantization_targets`` and the experts' own ``quantize_experts``. Not here: padded batches, device maps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maskkv_cli.models.base import Rope, rotate_in_dtype
from maskkv_cli.models.config import ModelConfig, diffusion_gemma_config
from maskkv_cli.models.diffusion_gemma_attention import attend, attend_causal, entry_mask
from maskkv_cli.models.diffusion_gemma_cache import KVStore, LayerKV, PromptCache, canvas_room, with_room
from maskkv_cli.models.diffusion_gemma_config import ENCODER_CHUNK, DiffusionGemmaConfig, LayerSpec, RopeSpec
from maskkv_cli.models.meta import meta_device
from maskkv_cli.models.rows import Linear, at_least_rows, linear

DECODER = "model.decoder."
ENCODER_TEXT = "model.encoder.language_model."
# checkpoint keys of the vision tower and its projection: not part of the text model, never read
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


# ----- norms, RoPE, MLP -----------------------------------------------------------------------------------------

def unit_rms(x: Tensor, eps: float) -> Tensor:
    """``x / rms(x)`` over the last dim in fp32, cast back (Gemma's norm without a weight)."""
    x32 = x.float()
    return (x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


class GemmaRMSNorm(nn.Module):
    """Gemma-4's RMSNorm: normalised and scaled by ``weight`` in fp32, then cast back (no "+1" on the weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (y * self.weight.float()).type_as(x)


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> Tensor:
    """The head_dim / 2 RoPE frequencies (fp32) of one layer kind.

    ``default``: ``theta^(-2i / head_dim)``. ``proportional`` (full layers): only the first
    ``int(partial_rotary_factor * head_dim // 2)`` frequencies, with the exponent still over the whole head dim,
    the rest 0 (those dim pairs (i, i + head_dim / 2) do not rotate), all divided by ``factor``."""
    if rope.rope_type == "default":
        return 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles)))  # (head_dim / 2,)
    return inv_freq / rope.factor


def rope_tables(positions: Tensor, rope: RopeSpec, head_dim: int) -> Rope:
    """fp32 cos/sin (T, head_dim) of integer ``positions`` (T,) in the rotate-half layout."""
    inv_freq = inverse_frequencies(rope, head_dim).to(positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    return Rope(angles.cos(), angles.sin())


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``: every layer's dense MLP and the self-conditioning MLP."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = Linear(d_model, hidden, bias=False)
        self.up_proj = Linear(d_model, hidden, bias=False)
        self.down_proj = Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


# ----- attention, experts, the layer ----------------------------------------------------------------------------

class Attention(nn.Module):
    """One layer's projections; ``v_proj`` only on sliding layers."""

    def __init__(self, cfg: DiffusionGemmaConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.spec, self.n_heads, self.eps = spec, cfg.n_heads, cfg.rms_norm_eps
        d, hd, kv = cfg.d_model, spec.head_dim, spec.n_kv_heads
        self.q_proj = Linear(d, cfg.n_heads * hd, bias=False)
        self.k_proj = Linear(d, kv * hd, bias=False)
        self.v_proj = Linear(d, kv * hd, bias=False) if spec.has_v_proj else None
        self.o_proj = Linear(cfg.n_heads * hd, d, bias=False)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)

    def heads(self, t: Tensor, n: int) -> Tensor:
        """(B, T, n * D) -> (B, n, T, D)."""
        b, length, _ = t.shape
        return t.view(b, length, n, self.spec.head_dim).transpose(1, 2)

    def qkv(self, n: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, T, D) and k (B, H_kv, T, D) normalised and rotated, v (B, H_kv, T, D) unit-RMS, of the
        normalised layer input n (B, T, d)."""
        kv = self.spec.n_kv_heads
        q = rotate_in_dtype(self.q_norm(self.heads(self.q_proj(n), self.n_heads)), rope)  # (B, H, T, D)
        k_raw = self.heads(self.k_proj(n), kv)  # (B, H_kv, T, D)
        k = rotate_in_dtype(self.k_norm(k_raw), rope)
        v_raw = k_raw if self.v_proj is None else self.heads(self.v_proj(n), kv)  # full layers: value = raw key
        return q, k, unit_rms(v_raw, self.eps)

    def out(self, o: Tensor) -> Tensor:
        """(B, H, T, D) -> (B, T, d)."""
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class Router(nn.Module):
    """Softmax over all experts of ``proj(unit_rms(h) * scale / sqrt(d))`` in fp32; the top k renormalised to sum
    1, then times each chosen expert's ``per_expert_scale``."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.top_k, self.eps, self.root = cfg.top_k_experts, cfg.rms_norm_eps, cfg.d_model ** -0.5
        self.proj = Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.d_model))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.n_experts))

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """(experts (N, k) int64, weights (N, k) fp32) of the tokens h (N, d)."""
        z = unit_rms(h, self.eps) * self.scale * self.root  # (N, d)
        probs = self.proj(z).softmax(dim=-1, dtype=torch.float32)  # (N, E)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights * self.per_expert_scale[experts]


class Experts(nn.Module):
    """The experts as 3-D tensors (the checkpoint's layout): ``gate_up_proj`` (E, 2 I, d) holds each expert's gate
    rows then its up rows, ``down_proj`` (E, d, I).

    Run grouped, as ``models/moe.py`` runs experts: the (token, slot) pairs sorted by expert, one product per active
    expert over all its tokens (at least a few rows: ``models/rows.py``), the weighted outputs summed in fp32."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        e, d, i = cfg.n_experts, cfg.d_model, cfg.moe_hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e of rows x (r, d) -> (r, d)."""
        gate, up = linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)  # (r, I) each
        return linear(gelu_tanh(gate) * up, self.down_proj[e])

    def quantize_experts(self, quantize: Callable[[Tensor], Tensor]) -> None:
        """Each of ``gate_up_proj`` and ``down_proj`` that holds its 3-D tensor (loaded, not yet converted) becomes
        a ``ParameterList`` of its experts' matrices, each ``quantize(matrix)`` (``models/quantize.py``, weight-only
        int8 / int4); ``expert`` indexes either form alike. One still on the meta device waits for its weights."""
        for name in ("gate_up_proj", "down_proj"):
            stacked = self._parameters.get(name)
            if stacked is None or stacked.is_meta:
                continue
            matrices = [nn.Parameter(quantize(stacked.data[e]), requires_grad=False) for e in range(stacked.shape[0])]
            del self._parameters[name]
            del stacked
            self.add_module(name, nn.ParameterList(matrices))

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """``sum_j weights[:, j] * expert_{experts[:, j]}(x)`` for x (N, d), experts and weights (N, k)."""
        n, k = experts.shape
        flat = experts.reshape(-1)  # (N k,)
        order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.gate_up_proj)).tolist()  # experts (3-D or per expert)
        routed = x[order // k]  # (N k, d)
        out = torch.empty_like(routed)
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = routed[start : start + count]
                out[start : start + count] = at_least_rows(lambda r, e=e: self.expert(e, r), rows)
                start += count
        per_slot = torch.empty_like(out)
        per_slot[order] = out  # back to (token, slot) order
        summed = (per_slot.view(n, k, -1).float() * weights.float()[..., None]).sum(dim=1)  # (N, d)
        return summed.to(x.dtype)


class DiffusionGemmaLayer(nn.Module):
    """One layer, shared by the encoder and the decoder (they differ only in what the attention sees and in their
    layer scalars)."""

    def __init__(self, cfg: DiffusionGemmaConfig, i: int) -> None:
        super().__init__()
        d, eps = cfg.d_model, cfg.rms_norm_eps
        self.spec = cfg.layer(i)
        # the layer's geometry as the engine's memory model reads it from every family's blocks
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, self.spec.n_kv_heads, self.spec.head_dim
        self.self_attn = Attention(cfg, self.spec)
        self.mlp = GatedMLP(d, cfg.mlp_hidden_size)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(d, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # the decoder's
        self.register_buffer("encoder_layer_scalar", torch.ones(1))  # the encoder's (not tied upstream)

    def qkv(self, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated q, k and v of the layer input x (B, T, d)."""
        return self.self_attn.qkv(self.input_layernorm(x), rope)

    def finish(self, x: Tensor, o: Tensor, scalar: Tensor) -> Tensor:
        """The layer output from its input x (B, T, d) and the attention output o (B, H, T, D)."""
        h = x + self.post_attention_layernorm(self.self_attn.out(o))  # (B, T, d)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        flat = h.reshape(-1, h.shape[-1])  # (B T, d)
        experts, weights = self.router(flat)  # the router reads the un-normalised stream
        moe = self.experts(self.pre_feedforward_layernorm_2(flat), experts, weights).view(h.shape)
        moe = self.post_feedforward_layernorm_2(moe)
        return (h + self.post_feedforward_layernorm(dense + moe)) * scalar


class SelfConditioning(nn.Module):
    """The decoder's input: ``unit_rms(e + MLP(pre_norm(s)))`` for the canvas embedding e and the soft embedding s
    of the previous step's logits (``post_norm`` has no weight)."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.pre_norm = GemmaRMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.gate_proj = Linear(cfg.d_model, cfg.mlp_hidden_size, bias=False)
        self.up_proj = Linear(cfg.d_model, cfg.mlp_hidden_size, bias=False)
        self.down_proj = Linear(cfg.mlp_hidden_size, cfg.d_model, bias=False)

    def forward(self, e: Tensor, soft: Tensor | None) -> Tensor:
        """e, soft (B, C, d); ``soft=None`` is the zero signal (the MLP of zeros is exactly zero: skipped)."""
        if soft is not None:
            n = self.pre_norm(soft)
            e = e + self.down_proj(gelu_tanh(self.gate_proj(n)) * self.up_proj(n))
        return unit_rms(e, self.eps)


# Called by ``encode`` (once per chunk) and ``decode`` with (layer index, layer input x (B, T, d), rotated q (B, H, T,
# D), and the keys and values the queries attend to, cached entries first (B, H_kv, T_l + T, D)), before the layer's
# attention.
LayerObserver = Callable[[int, Tensor, Tensor, Tensor, Tensor], None]


@dataclass(frozen=True)
class EncoderOutput:
    cache: PromptCache
    last_hidden_state: Tensor | None = None  # (B, T, d): the final norm of the last layer's output
    hidden_states: tuple[Tensor, ...] | None = None  # the embedding, then each layer's output, (B, T, d) each


def _visible_prompt(kv: LayerKV, spec: LayerSpec) -> LayerKV:
    """The cached entries the decoder's canvas sees on this layer: all of them on full layers, the latest W - 1 on
    sliding layers (what transformers' dynamic sliding cache holds; its decoder then applies no window)."""
    keep = spec.cached_prompt_entries
    if keep is None or kv.keys.shape[2] <= keep:
        return kv
    start = kv.keys.shape[2] - keep
    kept = None if kv.kept is None else kv.kept[:, :, start:]
    return LayerKV(kv.keys[:, :, start:], kv.values[:, :, start:], kept)


# ----- the model -------------------------------------------------------------------------------------------------

def gemma_config(cfg: ModelConfig | DiffusionGemmaConfig) -> DiffusionGemmaConfig:
    """The family's own config of either form."""
    if isinstance(cfg, DiffusionGemmaConfig):
        return cfg
    if cfg.family_config is None:
        raise ValueError(f"a {cfg.family} config is not a DiffusionGemma config")
    return cfg.family_config


class DiffusionGemma(nn.Module):
    """``encode(prompt ids) -> PromptCache``; ``decode(canvas, cache, previous logits) -> canvas logits``;
    ``commit(cache, canvas tokens) -> PromptCache``.

    ``config`` is the ``ModelConfig`` the rest of maskkv reads (``models.config.diffusion_gemma_config``), ``gemma``
    the family's own config, per layer; either builds the model."""

    layer_devices: list[torch.device] | None = None  # never spread over devices (``Family.device_map``)

    def __init__(self, cfg: ModelConfig | DiffusionGemmaConfig) -> None:
        super().__init__()
        self.gemma = gemma_config(cfg)
        self.config = cfg if isinstance(cfg, ModelConfig) else diffusion_gemma_config(cfg)
        cfg = self.gemma
        self.model = nn.ModuleDict({"decoder": nn.ModuleDict({
            "embed_tokens": nn.Embedding(cfg.vocab_size, cfg.d_model),
            "layers": nn.ModuleList(DiffusionGemmaLayer(cfg, i) for i in range(cfg.n_layers)),
            "norm": GemmaRMSNorm(cfg.d_model, cfg.rms_norm_eps),
            "self_conditioning": SelfConditioning(cfg),
        })})

    # ----- parts -------------------------------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.model["decoder"]["layers"]  # type: ignore[index,return-value]

    @property
    def blocks(self) -> nn.ModuleList:
        """The layers, under the name the engine's memory model reads every family's layers by (each states its
        heads and head size)."""
        return self.layers

    @property
    def embedding(self) -> nn.Embedding:
        return self.model["decoder"]["embed_tokens"]  # type: ignore[index,return-value]

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    def embed(self, ids: Tensor) -> Tensor:
        """(B, T) -> (B, T, d): the embedding times sqrt(d), the scale cast to the weight dtype first (bf16: 8.0 for
        d = 64, 53.0 for 2816)."""
        w = self.embedding.weight
        return F.embedding(ids, w) * torch.tensor(math.sqrt(self.gemma.d_model), dtype=w.dtype, device=w.device)

    def rope(self, positions: Tensor) -> dict[str, Rope]:
        """The RoPE tables of each layer kind present, for these positions (T,)."""
        tables = {}
        for spec in self.layers_by_kind().values():
            tables[spec.kind] = rope_tables(positions, spec.rope, spec.head_dim)
        return tables

    def layers_by_kind(self) -> dict[str, LayerSpec]:
        """The first layer of each kind present (all layers of one kind share head dim and RoPE)."""
        found: dict[str, LayerSpec] = {}
        for i in range(self.gemma.n_layers):
            found.setdefault(self.gemma.layer_types[i], self.gemma.layer(i))
        return found

    def head(self, x: Tensor) -> Tensor:
        """Final norm, the tied embedding as output projection, logits in fp32 soft-capped: (B, T, d) -> (B, T, V)."""
        norm = self.model["decoder"]["norm"]  # type: ignore[index]
        logits = linear(norm(x), self.embedding.weight).float()
        cap = self.gemma.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def empty_cache(self, batch_size: int = 1) -> PromptCache:
        """A cache of no positions (what ``encode`` starts from without one)."""
        layers = []
        for layer in self.layers:
            spec = layer.spec
            empty = torch.empty(batch_size, spec.n_kv_heads, 0, spec.head_dim, dtype=self.dtype, device=self.device)
            layers.append(LayerKV(empty, empty))
        return PromptCache(tuple(layers), 0)

    # ----- the encoder -------------------------------------------------------------------------------------------
    def encode(self, ids: Tensor, cache: PromptCache | None = None, hidden_states: bool = False,
               observe: LayerObserver | None = None, spare: int = 0, chunk: int | None = None) -> EncoderOutput:
        """The causal pass over ids (B, n) at positions ``cache.length ..`` (0 .. without a cache): the cache with
        these n positions appended, and, with ``hidden_states``, the normed last hidden state and each layer's
        output.

        The ids run in chunks of ``chunk`` rows (default ``ENCODER_CHUNK``) from the first (every layer for one
        chunk, then the next), each attending over the cache so far: the chunks are part of the definition (a
        prompt is always encoded in the same chunks, whoever encodes it), and the memory is linear in the prompt.
        A full layer's entries are
        written into a store with room for all n (``diffusion_gemma_cache.with_room``: in place where the cache
        allows) plus ``spare`` more for later commits and the decoder's canvas; a sliding layer keeps the latest
        W - 1. A compressed layer's slots (``LayerKV.kept``) all lie before ``cache.length``: every new query sees
        its kept entries (never its padding), and the new entries join it uncompressed. ``observe``: see
        ``LayerObserver`` (called once per chunk and layer)."""
        if cache is None:
            cache = self.empty_cache(ids.shape[0])
        n, start = ids.shape[1], cache.length
        layers = list(cache.layers)
        stores = [None if layer.spec.sliding else with_room(kv, n, spare) for layer, kv in zip(self.layers, layers,
                                                                                               strict=True)]
        outputs: list[list[Tensor]] | None = [[] for _ in range(len(layers) + 1)] if hidden_states else None
        for first, last in self.encoder_chunks(0, n, chunk):
            ropes = self.rope(torch.arange(start + first, start + last, device=ids.device))
            x = self.embed(ids[:, first:last])  # (B, r, d)
            if outputs is not None:
                outputs[0].append(x)
            for i in range(len(layers)):
                x, layers[i] = self.encode_layer(i, x, ropes, layers[i], stores[i], observe)
                if outputs is not None:
                    outputs[i + 1].append(x)
        new_cache = PromptCache(tuple(layers), start + n)
        if outputs is None:
            return EncoderOutput(new_cache)
        norm = self.model["decoder"]["norm"]  # type: ignore[index]
        whole = tuple(torch.cat(parts, dim=1) for parts in outputs)
        return EncoderOutput(new_cache, norm(whole[-1]), whole)

    @staticmethod
    def encoder_chunks(start: int, stop: int, chunk: int | None = None) -> list[tuple[int, int]]:
        """The chunks ``encode`` runs positions ``start .. stop - 1`` in: (first, last + 1) of each, ``chunk``
        (default ``ENCODER_CHUNK``) at a time from ``start``."""
        step = chunk or ENCODER_CHUNK
        return [(a, min(a + step, stop)) for a in range(start, stop, step)]

    def encode_layer(self, i: int, x: Tensor, ropes: dict[str, Rope], kv: LayerKV, store: KVStore | None,
                     observe: LayerObserver | None = None) -> tuple[Tensor, LayerKV]:
        """Layer i of the encoder on one chunk x (B, r, d) at the positions of ``ropes``, over the layer's cache
        ``kv``: the layer's output and its cache with the chunk's entries. A full layer writes them into ``store``
        (``with_room(kv, ...)``: the entries so far and room for these), a sliding layer (``store`` None) keeps
        the latest W - 1."""
        layer = self.layers[i]
        spec: LayerSpec = layer.spec
        q, k, v = layer.qkv(x, ropes[spec.kind])  # q (B, H, r, D); k, v (B, H_kv, r, D)
        if store is None:  # sliding: the latest W - 1 entries, then these (bounded: never the whole prompt)
            first = kv.length
            keys, values = torch.cat((kv.keys, k), dim=2), torch.cat((kv.values, v), dim=2)
            kept = None
        else:  # full: written in place after the entries so far
            first = store.filled
            store.write(first, k, v)
            seen = store.view(first + k.shape[2])
            keys, values, kept = seen.keys, seen.values, seen.kept
        if observe is not None:
            observe(spec.index, x, q, keys, values)
        o = attend_causal(q, keys, values, first, spec.window, kept)  # (B, H, r, D)
        if store is None:
            keep = spec.cached_prompt_entries
            assert keep is not None
            last = max(keys.shape[2] - keep, 0)
            kv = LayerKV(keys[:, :, last:].clone(), values[:, :, last:].clone())
        else:
            kv = store.view(store.filled)
        return layer.finish(x, o, layer.encoder_layer_scalar), kv

    def commit(self, cache: PromptCache, tokens: Tensor) -> PromptCache:
        """The cache with a finished canvas's tokens (B, C) appended (run through the encoder, as upstream)."""
        return self.encode(tokens, cache).cache

    # ----- the decoder -------------------------------------------------------------------------------------------
    def soft_embedding(self, logits: Tensor, row_mask: Tensor | None = None) -> Tensor:
        """``softmax(logits) @ embedding * sqrt(d)`` for logits (B, C, V) -> (B, C, d); rows where ``row_mask`` (B,)
        is False get zeros (no signal)."""
        w = self.embedding.weight
        soft = logits.softmax(dim=-1, dtype=torch.float32).to(w.dtype) @ w  # (B, C, d)
        soft = soft * torch.tensor(math.sqrt(self.gemma.d_model), dtype=w.dtype, device=w.device)
        if row_mask is not None:
            soft = soft * row_mask.to(soft.dtype)[:, None, None]
        return soft

    def decode(self, canvas: Tensor, cache: PromptCache, self_conditioning_logits: Tensor | None = None,
               self_conditioning_mask: Tensor | None = None, observe: LayerObserver | None = None) -> Tensor:
        """Logits (B, C, V) fp32 of the canvas ids (B, C) at positions ``cache.length ..``, attending over each
        layer's visible prompt entries (a compressed layer's kept slots only) and the whole canvas;
        ``self_conditioning_logits`` (B, C, V): the previous step's (tempered) logits, None at a canvas's first
        step. The cache is not changed. ``observe``: see ``LayerObserver``."""
        c, start = canvas.shape[1], cache.length
        ropes = self.rope(torch.arange(start, start + c, device=canvas.device))
        x = self.decoder_input(canvas, self_conditioning_logits, self_conditioning_mask)
        for i, kv in enumerate(cache):
            x = self.decode_layer(i, x, kv, ropes, observe)
        return self.head(x)

    def decoder_input(self, canvas: Tensor, self_conditioning_logits: Tensor | None = None,
                      self_conditioning_mask: Tensor | None = None) -> Tensor:
        """The decoder's first layer input (B, C, d): the canvas embedding with the self-conditioning signal."""
        soft = None if self_conditioning_logits is None else self.soft_embedding(
            self_conditioning_logits, self_conditioning_mask)
        return self.model["decoder"]["self_conditioning"](self.embed(canvas), soft)  # type: ignore[index,no-any-return]

    def decode_layer(self, i: int, x: Tensor, kv: LayerKV, ropes: dict[str, Rope],
                     observe: LayerObserver | None = None) -> Tensor:
        """Layer i of the decoder on the canvas rows x (B, C, d) over the layer's cache ``kv`` (its visible prompt
        entries, a compressed layer's kept slots only) and the canvas itself: the layer's output."""
        layer = self.layers[i]
        q, k, v = layer.qkv(x, ropes[layer.spec.kind])  # q (B, H, C, D); k, v (B, H_kv, C, D)
        # (B, H_kv, T_vis + C, D): the prompt's entries, then the canvas's (in the store's room where it has some)
        seen = canvas_room(_visible_prompt(kv, layer.spec), k, v)
        if observe is not None:
            observe(layer.spec.index, x, q, seen.keys, seen.values)
        mask = None if seen.kept is None else seen.kept[:, :, None, :]  # bidirectional: None unless compressed
        return layer.finish(x, attend(q, seen.keys, seen.values, mask), layer.layer_scalar)

    def quantization_targets(self) -> list[str]:
        """The linear layers ``models/quantize.py`` quantizes (besides the experts, ``Experts.quantize_experts``):
        every layer's attention and dense MLP projections and the self-conditioning MLP; not the routers (their
        scores choose the experts) nor the tied embedding and head."""
        return [name for name, m in self.named_modules() if isinstance(m, Linear) and not name.endswith("router.proj")]

    # ----- checkpoint keys ---------------------------------------------------------------------------------------
    @staticmethod
    def checkpoint_key(name: str) -> str:
        """Parameter or buffer name -> the checkpoint key transformers writes."""
        if name.endswith(".encoder_layer_scalar"):
            return ENCODER_TEXT + name.removeprefix(DECODER).removesuffix("encoder_layer_scalar") + "layer_scalar"
        return name

    @staticmethod
    def parameter_name(key: str) -> str | None:
        """Checkpoint key -> parameter or buffer name; None for a key of the vision tower (never loaded).

        Text weights are stored on the decoder's side (the encoder's are tied to them); a checkpoint that stores
        the encoder's side (``model.encoder.language_model.*``) or the head (``lm_head.weight``) maps to the same
        parameters. The encoder's layer scalars are their own buffers."""
        if key.startswith(VISION_PREFIXES):
            return None
        if key.startswith(ENCODER_TEXT):
            rest = key.removeprefix(ENCODER_TEXT)
            if rest.endswith(".layer_scalar"):
                return DECODER + rest.removesuffix("layer_scalar") + "encoder_layer_scalar"
            return DECODER + rest
        if key == "lm_head.weight":
            return DECODER + "embed_tokens.weight"
        return key

    def init_weights(self, seed: int = 0, std: float = 0.02) -> DiffusionGemma:
        """Random normal weights (norm weights, router scales and layer scalars at one), reproducible from seed."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", ".scale", "per_expert_scale")):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype) * std)
            for buf in self.buffers():
                buf.fill_(1.0)
        return self

    def init_spread_weights(self, seed: int = 0) -> DiffusionGemma:
        """Random weights under which the choice of kept prompt entries shows in the logits (for tests and tiny
        measurements of the compressed cache): vectors (norm weights, router scales) and buffers (layer scalars)
        uniform in [0.5, 1.5), the embedding N(0, 1.5^2), every matrix N(0, 1 / fan-in); reproducible from seed."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.copy_(0.5 + torch.rand(p.shape, generator=gen))
                elif "embed_tokens" in name:
                    p.copy_(1.5 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            for buf in self.buffers():
                buf.copy_(0.5 + torch.rand(buf.shape, generator=gen))
        return self


def checkpoint_shapes(cfg: ModelConfig | DiffusionGemmaConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of every tensor the model reads (parameters and layer scalars), from the config."""
    with meta_device():
        model = DiffusionGemma(cfg)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {DiffusionGemma.checkpoint_key(name): tuple(t.shape) for name, t in tensors}


def parameter_count(cfg: ModelConfig | DiffusionGemmaConfig) -> int:
    """Parameters of the text model (the tied embedding once, no vision tower), counted on the meta device."""
    with meta_device():
        model = DiffusionGemma(cfg)
    return sum(p.numel() for p in model.parameters())


__all__ = ["DiffusionGemma", "EncoderOutput", "LayerKV", "LayerObserver", "PromptCache", "attend",
           "checkpoint_shapes", "entry_mask", "gemma_config", "parameter_count", "rope_tables"]
