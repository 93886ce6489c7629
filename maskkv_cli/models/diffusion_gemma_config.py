"""DiffusionGemma's configuration: a frozen dataclass of its own, its ``config.json`` reader and named shapes.

DiffusionGemma (``model_type: diffusion_gemma``, e.g. google/diffusiongemma-26B-A4B-it) does not fit
``models.config.ModelConfig``: its layers differ from each other. Sliding-window layers have ``head_dim`` dims and
``num_key_value_heads`` KV heads, default RoPE with theta 1e4; full-attention layers have ``global_head_dim`` dims,
``num_global_key_value_heads`` KV heads, no value projection and "proportional" partial RoPE with theta 1e6. So
this module keeps its own config and answers per layer (``layer(i)`` -> ``LayerSpec``). The rest of maskkv reads
the ``ModelConfig`` that ``models.config.diffusion_gemma_config`` makes of it (its ``family_config`` is this one).

``from_hf`` reads both layouts a ``config.json`` comes in:

- the released one: ``text_config`` with ``global_head_dim`` / ``num_global_key_value_heads`` (transformers turns
  them into per-layer overrides of the full layers);
- the one ``save_pretrained`` writes: ``text_config.per_layer_config`` (``{"1": {"head_dim": 32,
  "num_key_value_heads": 1}, ...}``); when present it alone decides, as in transformers (``global_head_dim`` is
  then ignored).

The reference: transformers' ``models/diffusion_gemma/configuration_diffusion_gemma.py`` (5.25).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from maskkv_cli.errors import ModelLoadError, UsageError

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_KINDS = (SLIDING, FULL)
ROPE_TYPES = ("default", "proportional")
# Prompt rows the encoder runs at once (``DiffusionGemma.encode``): a prompt is always encoded in chunks of this many
# tokens from its first (or from a document's end), so its numbers do not depend on who encodes it; the memory
# model (``engine/batch_memory.py``) counts one chunk's activations.
ENCODER_CHUNK = 512
# Entries of one boolean attention mask (rows x keys) the encoder builds (``models/diffusion_gemma_attention.py``):
# 32 Mi -> 32 MiB of booleans and the additive mask SDPA makes of it in the query's dtype (64 MiB in bf16). At a
# 262k-token cache a block is 128 rows (16 where CUDA folds 8 query heads into each KV head's rows).
MASK_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer kind. ``proportional`` rotates only the ``partial_rotary_factor`` lowest frequencies, with
    exponents over the whole head dim (``models.diffusion_gemma.inverse_frequencies``)."""

    rope_type: str = "default"
    theta: float = 10_000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0  # proportional: every frequency divided by this (1 in the released model)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UsageError(f"DiffusionGemma config: rope_type {self.rope_type!r} is not supported "
                             f"(known: {', '.join(ROPE_TYPES)})")
        if self.rope_type == "default" and self.partial_rotary_factor != 1.0:
            raise UsageError("DiffusionGemma config: partial rotary RoPE is only supported as rope_type 'proportional'")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.theta <= 0 or self.factor <= 0:
            raise UsageError("DiffusionGemma config: RoPE theta and factor must be positive and the partial rotary "
                             "factor in (0, 1]")


@dataclass(frozen=True)
class LayerSpec:
    """The geometry of one layer, resolved from the config."""

    index: int
    kind: str  # SLIDING or FULL
    head_dim: int
    n_kv_heads: int
    rope: RopeSpec
    window: int | None  # sliding layers: the window W (a query sees itself and W - 1 earlier tokens); full: None

    @property
    def sliding(self) -> bool:
        return self.kind == SLIDING

    @property
    def has_v_proj(self) -> bool:
        """Full layers have no value projection: their values are the raw key projection, unit-RMS normalised."""
        return self.sliding

    @property
    def cached_prompt_entries(self) -> int | None:
        """How many of the latest prompt positions this layer's cache keeps (and the decoder sees): W - 1 on sliding
        layers, as transformers' dynamic sliding-window cache; None (all of them) on full layers."""
        return None if self.window is None else self.window - 1


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    """The text model of DiffusionGemma (the vision tower is not part of it)."""

    vocab_size: int
    d_model: int  # hidden_size
    mlp_hidden_size: int  # intermediate_size: the dense MLP of every layer and the self-conditioning MLP
    n_layers: int
    n_heads: int  # query heads, the same on every layer
    n_kv_heads: int  # num_key_value_heads: KV heads of sliding layers (and of any layer without an override)
    head_dim: int  # head dim of sliding layers (and of any layer without an override)
    layer_types: tuple[str, ...]
    n_experts: int
    top_k_experts: int
    moe_hidden_size: int  # moe_intermediate_size: each expert's width
    global_head_dim: int = 512  # full layers' head dim when no per-layer overrides are given
    n_global_kv_heads: int | None = None  # full layers' KV heads then (None: n_kv_heads)
    # explicit per-layer overrides (layer, head_dim or None, KV heads or None), from ``per_layer_config``; when set
    # they replace the global_* defaults entirely, as in transformers
    layer_overrides: tuple[tuple[int, int | None, int | None], ...] | None = None
    sliding_window: int = 512
    rope_sliding: RopeSpec = RopeSpec("default", 10_000.0)
    rope_full: RopeSpec = RopeSpec("proportional", 1_000_000.0, 0.25)
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0  # logits = cap * tanh(logits / cap); None: no capping
    max_position_embeddings: int = 131_072
    canvas_length: int = 256  # the decoder's block length
    pad_token_id: int = 0
    bos_token_id: int | None = 2
    eos_token_ids: tuple[int, ...] = (1,)
    use_bidirectional_attention: str | None = None  # None or "vision": text is causal in the encoder

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "mlp_hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "n_experts", "top_k_experts", "moe_hidden_size", "global_head_dim", "sliding_window",
                     "canvas_length"):
            if getattr(self, name) <= 0:
                raise UsageError(f"DiffusionGemma config: {name} must be positive, got {getattr(self, name)}")
        if len(self.layer_types) != self.n_layers:
            raise UsageError(f"DiffusionGemma config: {len(self.layer_types)} layer_types for {self.n_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise UsageError(f"DiffusionGemma config: unknown layer types {', '.join(unknown)}")
        if self.top_k_experts > self.n_experts:
            raise UsageError(f"DiffusionGemma config: top {self.top_k_experts} of {self.n_experts} experts")
        if self.use_bidirectional_attention == "all":
            raise UsageError("DiffusionGemma config: use_bidirectional_attention='all' (a bidirectional encoder) "
                             "is not supported; the released model uses 'vision' (text causal)")
        dims: dict[str, set[int]] = {SLIDING: set(), FULL: set()}
        for spec in self.layers:
            if self.n_heads % spec.n_kv_heads or spec.head_dim % 2:
                raise UsageError(f"DiffusionGemma config: layer {spec.index}: {self.n_heads} query heads over "
                                 f"{spec.n_kv_heads} KV heads of {spec.head_dim} dims (heads must divide, dims even)")
            dims[spec.kind].add(spec.head_dim)
        if any(len(d) > 1 for d in dims.values()):  # RoPE tables are per layer kind, as in transformers
            raise UsageError("DiffusionGemma config: all layers of one kind must share their head dim")

    def layer(self, i: int) -> LayerSpec:
        """Layer ``i``'s kind, head dim, KV heads, RoPE and window."""
        kind = self.layer_types[i]
        if self.layer_overrides is None:
            full = kind == FULL
            head_dim = self.global_head_dim if full else self.head_dim
            kv = (self.n_global_kv_heads or self.n_kv_heads) if full else self.n_kv_heads
        else:
            head_dim, kv = self.head_dim, self.n_kv_heads
            for layer, dim, heads in self.layer_overrides:
                if layer == i:
                    head_dim, kv = dim or head_dim, heads or kv
        rope = self.rope_sliding if kind == SLIDING else self.rope_full
        return LayerSpec(i, kind, head_dim, kv, rope, self.sliding_window if kind == SLIDING else None)

    @property
    def layers(self) -> tuple[LayerSpec, ...]:
        return tuple(self.layer(i) for i in range(self.n_layers))

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The full-attention layers: the only ones whose cache grows with the prompt."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL)

    @property
    def cuts_layer_by_layer(self) -> bool:
        """Whether a cache the first step cuts is encoded layer by layer with the cut interleaved
        (``sampling/diffusion_gemma_forward.encode_and_cut``): it holds the prompt's hidden states and one whole
        full layer instead of every full layer whole, so it is chosen where that is less per position (the released
        model: 2,816 + 2,048 values against 5 x 2,048; not where the full layers are few or narrow)."""
        full = [2 * s.n_kv_heads * s.head_dim for s in self.layers if not s.sliding]
        return len(full) > 1 and self.d_model + max(full) < sum(full)

    def with_(self, **changes: Any) -> DiffusionGemmaConfig:
        return replace(self, **changes)


# ----- config.json ---------------------------------------------------------------------------------------------

def _ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(int(v) for v in value) if isinstance(value, list | tuple) else (int(value),)


def _rope(params: Any, kind: str, source: str) -> RopeSpec:
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source}: rope_parameters has no entry for {kind}")
    try:
        return RopeSpec(str(params.get("rope_type", "default")), float(params["rope_theta"]),
                        float(params.get("partial_rotary_factor", 1.0)), float(params.get("factor", 1.0)))
    except KeyError:
        raise ModelLoadError(f"{source}: rope_parameters[{kind!r}] has no rope_theta") from None
    except UsageError as exc:
        raise ModelLoadError(f"{source}: {exc}") from None


def from_hf(data: dict[str, Any], source: str = "config.json") -> DiffusionGemmaConfig:
    """A ``config.json`` (``model_type: diffusion_gemma`` with a ``text_config``, or a bare text config) as a
    ``DiffusionGemmaConfig``; defaults are transformers' class defaults where a field is absent (spec section 1)."""
    text = data.get("text_config", data)
    if not isinstance(text, dict):
        raise ModelLoadError(f"{source}: text_config is not an object")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts",
                "top_k_experts", "moe_intermediate_size")
    missing = [k for k in required if text.get(k) is None]
    if missing:
        raise ModelLoadError(f"{source}: text_config lacks {', '.join(missing)} (DiffusionGemma always has experts)")
    if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{source}: hidden_activation {text['hidden_activation']!r} is not supported")
    if data.get("tie_word_embeddings") is False or text.get("tie_word_embeddings") is False:
        raise ModelLoadError(f"{source}: tie_word_embeddings=false (separate encoder, decoder and head weights) "
                             "is not supported")
    if text.get("attention_bias"):
        raise ModelLoadError(f"{source}: attention_bias=true is not supported")
    n_layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None:  # transformers' default: 5 sliding layers, then 1 full, repeated
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    types = list(types)
    if types and types[-1] != FULL:  # transformers forces the last layer to full attention (with a warning)
        types[-1] = FULL
    rope = text.get("rope_parameters") or {}
    per_layer = text.get("per_layer_config")
    overrides = None
    if per_layer is not None:
        overrides = tuple(sorted((int(k), v.get("head_dim"), v.get("num_key_value_heads"))
                                 for k, v in per_layer.items()))
    soft = text.get("final_logit_softcapping", 30.0)
    eos = _ids(data.get("eos_token_id")) if "text_config" in data else None
    try:
        return DiffusionGemmaConfig(
            vocab_size=int(text["vocab_size"]), d_model=int(text["hidden_size"]),
            mlp_hidden_size=int(text.get("intermediate_size", 9216)), n_layers=n_layers,
            n_heads=int(text["num_attention_heads"]), n_kv_heads=int(text.get("num_key_value_heads", 4)),
            head_dim=int(text.get("head_dim", 256)), layer_types=tuple(types), n_experts=int(text["num_experts"]),
            top_k_experts=int(text["top_k_experts"]), moe_hidden_size=int(text["moe_intermediate_size"]),
            global_head_dim=int(text.get("global_head_dim") or 512),
            n_global_kv_heads=None if text.get("num_global_key_value_heads") is None
            else int(text["num_global_key_value_heads"]),
            layer_overrides=overrides, sliding_window=int(text.get("sliding_window", 512)),
            rope_sliding=_rope(rope.get(SLIDING, {"rope_type": "default", "rope_theta": 10_000.0}), SLIDING, source),
            rope_full=_rope(rope.get(FULL, {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1_000_000.0}), FULL, source),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=None if soft is None else float(soft),
            max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
            canvas_length=int(data.get("canvas_length") or 256),
            pad_token_id=int(text.get("pad_token_id") if text.get("pad_token_id") is not None else 0),
            bos_token_id=None if text.get("bos_token_id") is None else int(text["bos_token_id"]),
            eos_token_ids=eos or _ids(text.get("eos_token_id")) or (),
            use_bidirectional_attention=text.get("use_bidirectional_attention"),
        )
    except UsageError as exc:
        raise ModelLoadError(f"{source}: {exc}") from None


def _rope_hf(rope: RopeSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type == "proportional":
        out["partial_rotary_factor"] = rope.partial_rotary_factor
    if rope.factor != 1.0:
        out["factor"] = rope.factor
    return out


def to_hf(cfg: DiffusionGemmaConfig) -> dict[str, Any]:
    """``cfg`` as a ``config.json`` in the released layout (text only: no ``vision_config``)."""
    text: dict[str, Any] = {
        "model_type": "diffusion_gemma_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden_size, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window,
        "rope_parameters": {SLIDING: _rope_hf(cfg.rope_sliding), FULL: _rope_hf(cfg.rope_full)},
        "num_experts": cfg.n_experts, "top_k_experts": cfg.top_k_experts, "moe_intermediate_size": cfg.moe_hidden_size,
        "rms_norm_eps": cfg.rms_norm_eps, "final_logit_softcapping": cfg.final_logit_softcapping,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_activation": "gelu_pytorch_tanh",
        "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None, "tie_word_embeddings": True,
        "attention_bias": False, "use_bidirectional_attention": cfg.use_bidirectional_attention,
    }
    if cfg.layer_overrides is None:
        text["global_head_dim"] = cfg.global_head_dim
        text["num_global_key_value_heads"] = cfg.n_global_kv_heads
    else:
        text["per_layer_config"] = {
            str(i): {k: v for k, v in (("head_dim", d), ("num_key_value_heads", h)) if v is not None}
            for i, d, h in cfg.layer_overrides}
    return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
            "text_config": text, "canvas_length": cfg.canvas_length, "tie_word_embeddings": True,
            "eos_token_id": list(cfg.eos_token_ids)}


# ----- named shapes --------------------------------------------------------------------------------------------

def _pattern(n_layers: int, period: int = 6) -> tuple[str, ...]:
    """``period - 1`` sliding layers, then one full layer, repeated (the last layer full)."""
    return tuple(SLIDING if (i + 1) % period else FULL for i in range(n_layers))


NAMED_CONFIGS: dict[str, DiffusionGemmaConfig] = {
    # runs in milliseconds on one CPU thread: two sliding and two full layers, a window shorter than the prompts
    # the tests use, partial RoPE on the full layers (4 of 16 frequencies), 4 experts of which 2 per token
    "diffusiongemma-tiny": DiffusionGemmaConfig(
        vocab_size=512, d_model=64, mlp_hidden_size=96, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
        layer_types=(SLIDING, FULL, SLIDING, FULL), n_experts=4, top_k_experts=2, moe_hidden_size=32,
        global_head_dim=32, n_global_kv_heads=1, sliding_window=8, max_position_embeddings=1024, canvas_length=8),
    # the released layer pattern, window, canvas and head geometry at a size one CPU runs (12 layers, 2 of them full,
    # 16 experts of which 4 per token, a 32k vocabulary): benchmarks of how the cache is run, not of quality
    "diffusiongemma-small": DiffusionGemmaConfig(
        vocab_size=32_768, d_model=1024, mlp_hidden_size=1024, n_layers=12, n_heads=8, n_kv_heads=4, head_dim=128,
        layer_types=_pattern(12), n_experts=16, top_k_experts=4, moe_hidden_size=512, global_head_dim=256,
        n_global_kv_heads=2, sliding_window=1024, max_position_embeddings=262_144, canvas_length=256,
        eos_token_ids=(1, 106, 50), use_bidirectional_attention="vision"),
    # google/diffusiongemma-26B-A4B-it's text model (spec section 1.1); for parameter counts on the meta device
    "diffusiongemma-26b-a4b": DiffusionGemmaConfig(
        vocab_size=262_144, d_model=2816, mlp_hidden_size=2112, n_layers=30, n_heads=16, n_kv_heads=8, head_dim=256,
        layer_types=_pattern(30), n_experts=128, top_k_experts=8, moe_hidden_size=704, global_head_dim=512,
        n_global_kv_heads=2, sliding_window=1024, max_position_embeddings=262_144, canvas_length=256,
        eos_token_ids=(1, 106, 50), use_bidirectional_attention="vision"),
}


def named_config(name: str) -> DiffusionGemmaConfig:
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise UsageError(f"unknown DiffusionGemma config {name!r}; choose one of: {', '.join(NAMED_CONFIGS)}") from None
