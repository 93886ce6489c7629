"""Model configuration: one frozen dataclass, named sizes, and each family's `config.json` mapping."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from maskkv_cli.errors import ModelLoadError, UsageError
from maskkv_cli.models.diffusion_gemma_config import DiffusionGemmaConfig
from maskkv_cli.models.diffusion_gemma_config import from_hf as diffusion_gemma_config_from_hf
from maskkv_cli.models.diffusion_gemma_config import to_hf as diffusion_gemma_config_to_hf

ATTENTION_PATTERNS = ("bidirectional", "block_causal")
ROUTERS = ("sigmoid_groups", "softmax")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: which layers have one, its experts and its router (``models/moe.py``)."""

    n_experts: int
    top_k: int  # experts per token
    expert_hidden: int  # each expert's SwiGLU width
    layers: tuple[bool, ...]  # per layer: True = MoE, False = the dense MLP of ``mlp_hidden_size``
    shared_hidden: int | None = None  # the unweighted shared expert's width (None: no shared expert)
    router: str = "sigmoid_groups"  # LLaDA2: sigmoid, group-limited top-k, normalised, scaled; LLaDA-MoE: softmax
    n_group: int = 1  # sigmoid_groups: expert groups, of which ``topk_group`` are kept per token
    topk_group: int = 1
    routed_scaling: float = 1.0  # sigmoid_groups: the normalised weights times this
    expert_bias: bool = True  # a per-expert bias added to the scores (selection only for sigmoid_groups)

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise UsageError(f"model config: unknown router {self.router!r} (known: {', '.join(ROUTERS)})")
        if min(self.n_experts, self.top_k, self.expert_hidden, self.n_group, self.topk_group) <= 0:
            raise UsageError("model config: expert counts, sizes and groups must be positive")
        if self.top_k > self.n_experts or self.n_experts % self.n_group or self.topk_group > self.n_group:
            raise UsageError(f"model config: {self.n_experts} experts, top {self.top_k}, {self.n_group} groups "
                             f"keeping {self.topk_group} do not fit together")
        if self.router == "sigmoid_groups" and self.top_k > self.topk_group * (self.n_experts // self.n_group):
            raise UsageError("model config: the kept expert groups hold fewer experts than num_experts_per_tok")


@dataclass(frozen=True)
class ModelConfig:
    """Shape, attention pattern, MLP kind and special tokens of a masked diffusion transformer."""

    d_model: int
    n_layers: int
    n_heads: int
    mlp_hidden_size: int
    vocab_size: int
    n_kv_heads: int | None = None
    embedding_size: int | None = None
    rope_theta: float = 500000.0
    max_sequence_length: int = 4096
    rms_norm_eps: float = 1e-5
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    bos_token_id: int | None = 126080
    eot_token_id: int | None = 126348
    family: str = "llada"  # a key of ``models.families.FAMILY_TABLE``
    logit_shift: int = 0  # Dream: 1 (position i is predicted from hidden state i - 1)
    head_dim_override: int | None = None  # None: d_model // n_heads (LLaDA2's config states it)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * this dims of each head (LLaDA2: 0.5)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (LLaDA2, LLaDA-MoE)
    attention_bias: bool = False  # biases on the q/k/v (and output) projections (LLaDA-MoE's attention_bias)
    clip_qkv: float | None = None  # LLaDA-MoE: q, k, v clamped to [-clip, clip]
    attention: str = "bidirectional"  # or "block_causal": a block sees itself and every earlier block (LLaDA2)
    moe: MoEConfig | None = None
    stop_token_ids: tuple[int, ...] = ()  # more ids that end an answer besides eos/eot (DiffusionGemma has three)
    # a family whose layers this class cannot describe keeps its own config here (DiffusionGemma: sliding and full
    # layers of different geometry); the fields above then describe its sliding layers and its special tokens
    family_config: DiffusionGemmaConfig | None = None

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.embedding_size is None:
            object.__setattr__(self, "embedding_size", self.vocab_size)
        for name in ("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise UsageError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.head_dim_override is None and self.d_model % self.n_heads:
            raise UsageError(f"model config: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2 or self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise UsageError(f"model config: head dim {self.head_dim} and rotary dims {self.rotary_dim} must be even "
                             "(and the rotary dims at most the head dim) for RoPE")
        if self.attention not in ATTENTION_PATTERNS:
            raise UsageError(f"model config: attention {self.attention!r} is not one of "
                             f"{', '.join(ATTENTION_PATTERNS)}")
        if self.moe is not None and len(self.moe.layers) != self.n_layers:
            raise UsageError(f"model config: the MoE layer list has {len(self.moe.layers)} entries for "
                             f"{self.n_layers} layers")
        if self.family == "llada" and self.n_kv_heads != self.n_heads:
            raise UsageError("LLaDA models have as many key/value heads as query heads (no GQA)")
        if self.n_heads % self.n_kv_heads:  # type: ignore[operator]
            raise UsageError(f"model config: {self.n_heads} query heads are not a multiple of {self.n_kv_heads} "
                             "key/value heads")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        return self.n_heads // self.n_kv_heads  # type: ignore[operator]

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def block_causal(self) -> bool:
        return self.attention == "block_causal"

    @property
    def evicted_layers(self) -> tuple[int, ...]:
        """The layers whose prompt cache a policy cuts (its layer budgets are over these): every layer, except in
        DiffusionGemma, whose sliding-window layers hold at most W - 1 entries and only its full layers are cut."""
        if self.family_config is not None:
            return self.family_config.full_layers
        return tuple(range(self.n_layers))

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----- config.json in the upstream formats (``models.families`` picks the pair by ``model_type``/``family``) -----
def llada_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "mlp_hidden_size": cfg.mlp_hidden_size,
        "mlp_ratio": max(1, cfg.mlp_hidden_size // cfg.d_model),
        "vocab_size": cfg.vocab_size,
        "embedding_size": cfg.embedding_size,
        "rope": True,
        "rope_theta": cfg.rope_theta,
        "rope_full_precision": True,
        "max_sequence_length": cfg.max_sequence_length,
        "rms_norm_eps": cfg.rms_norm_eps,
        "layer_norm_type": "rms",
        "activation_type": "silu",
        "block_type": "llama",
        "include_bias": False,
        "include_qkv_bias": False,
        "bias_for_layer_norm": False,
        "weight_tying": False,
        "alibi": False,
        "flash_attention": False,
        "attention_layer_norm": False,
        "input_emb_norm": False,
        "scale_logits": False,
        "attention_dropout": 0.0,
        "residual_dropout": 0.0,
        "embedding_dropout": 0.0,
        "mask_token_id": cfg.mask_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eot_token_id": cfg.eot_token_id,
        "torch_dtype": "bfloat16",
    }


def llada_from_hf(data: dict[str, Any], source: str) -> ModelConfig:
    missing = [k for k in ("d_model", "n_layers", "n_heads", "vocab_size") if k not in data]
    if missing:
        raise ModelLoadError(f"{source}: missing required fields {', '.join(missing)}")
    mlp = data.get("mlp_hidden_size") or data["d_model"] * int(data.get("mlp_ratio", 4))
    for flag in ("alibi", "include_bias", "include_qkv_bias", "weight_tying", "scale_logits"):
        if data.get(flag):
            raise ModelLoadError(f"{source}: {flag}=true is not supported by this LLaDA implementation")
    known = {f.name for f in fields(ModelConfig)}
    kwargs = {k: v for k, v in data.items() if k in known and v is not None}
    kwargs["mlp_hidden_size"] = int(mlp)
    for key in ("family", "logit_shift"):
        kwargs.pop(key, None)
    return ModelConfig(**kwargs)


def dream_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.mlp_hidden_size,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_sequence_length,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "mask_token_id": cfg.mask_token_id,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "eot_token_id": cfg.eot_token_id,
        "torch_dtype": "bfloat16",
    }


def dream_from_hf(data: dict[str, Any], source: str) -> ModelConfig:
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if k not in data]
    if missing:
        raise ModelLoadError(f"{source}: missing required fields {', '.join(missing)}")
    if data.get("tie_word_embeddings"):
        raise ModelLoadError(f"{source}: tie_word_embeddings=true is not supported for Dream")
    get = data.get
    return ModelConfig(
        d_model=data["hidden_size"], n_layers=data["num_hidden_layers"], n_heads=data["num_attention_heads"],
        n_kv_heads=get("num_key_value_heads") or data["num_attention_heads"],
        mlp_hidden_size=data["intermediate_size"], vocab_size=data["vocab_size"],
        rope_theta=float(get("rope_theta", 1e6)), rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        max_sequence_length=min(int(get("max_position_embeddings", 2048)), 2048) if "max_sequence_length"
        not in data else int(data["max_sequence_length"]),
        mask_token_id=int(get("mask_token_id", 151666)), eos_token_id=int(get("eos_token_id", 151643)),
        pad_token_id=int(get("pad_token_id", 151643)), bos_token_id=get("bos_token_id", 151643),
        eot_token_id=get("eot_token_id", 151645), family="dream", logit_shift=1,
    )


# The released LLaDA2 / LLaDA-MoE tokenizer's special ids (configs carry no mask or EOS id).
LING_MASK_ID, LING_EOS_ID = 156895, 156892


def _first_id(value: Any, default: int) -> int:
    """A token id field that may be a list (generation_config.json allows several EOS ids)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return default if value is None else int(value)


def _require(data: dict[str, Any], source: str, names: tuple[str, ...]) -> None:
    missing = [k for k in names if k not in data]
    if missing:
        raise ModelLoadError(f"{source}: missing required fields {', '.join(missing)}")


def _refuse(data: dict[str, Any], source: str, flags: tuple[str, ...], family: str) -> None:
    for flag in flags:
        if data.get(flag):
            raise ModelLoadError(f"{source}: {flag}={data[flag]!r} is not supported for {family}")


def llada2_from_hf(data: dict[str, Any], source: str) -> ModelConfig:
    """LLaDA2.x (``llada2_moe``): fields as the released configs name them (docs/models.md)."""
    _require(data, source, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                            "intermediate_size"))
    _refuse(data, source, ("use_qkv_bias", "use_bias", "tie_word_embeddings", "rope_scaling"), "LLaDA2")
    layers, heads, hidden = int(data["num_hidden_layers"]), int(data["num_attention_heads"]), int(data["hidden_size"])
    moe = None
    if data.get("num_experts"):
        _require(data, source, ("num_experts_per_tok", "moe_intermediate_size"))
        first_dense = int(data.get("first_k_dense_replace") or 0)
        shared = data.get("num_shared_experts")
        moe = MoEConfig(
            n_experts=int(data["num_experts"]), top_k=int(data["num_experts_per_tok"]),
            expert_hidden=int(data["moe_intermediate_size"]), layers=tuple(i >= first_dense for i in range(layers)),
            shared_hidden=int(data["moe_intermediate_size"]) * int(shared) if shared else None,
            router="sigmoid_groups", n_group=int(data.get("n_group") or 1), topk_group=int(data.get("topk_group") or 1),
            routed_scaling=float(data.get("routed_scaling_factor", 1.0)), expert_bias=True)
    head_dim = data.get("head_dim")
    get = data.get
    return ModelConfig(
        d_model=hidden, n_layers=layers, n_heads=heads, n_kv_heads=int(get("num_key_value_heads") or heads),
        mlp_hidden_size=int(data["intermediate_size"]), vocab_size=int(data["vocab_size"]),
        rope_theta=float(get("rope_theta", 600000.0)), max_sequence_length=int(get("max_position_embeddings", 16384)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)), mask_token_id=_first_id(get("mask_token_id"), LING_MASK_ID),
        eos_token_id=_first_id(get("eos_token_id"), LING_EOS_ID),
        pad_token_id=_first_id(get("pad_token_id"), LING_EOS_ID), bos_token_id=get("bos_token_id"), eot_token_id=None,
        family="llada2", head_dim_override=int(head_dim) if head_dim else None,
        partial_rotary_factor=float(get("partial_rotary_factor", 1.0)), qk_norm=bool(get("use_qk_norm", True)),
        attention="block_causal", moe=moe)


def llada2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    out: dict[str, Any] = {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_hidden_size, "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor,
        "max_position_embeddings": cfg.max_sequence_length, "rms_norm_eps": cfg.rms_norm_eps,
        "use_qk_norm": cfg.qk_norm, "use_qkv_bias": False, "use_bias": False, "hidden_act": "silu",
        "tie_word_embeddings": False, "mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id, "torch_dtype": "bfloat16",
    }
    if moe is not None:
        out.update({
            "num_experts": moe.n_experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_hidden,
            "num_shared_experts": (moe.shared_hidden // moe.expert_hidden) if moe.shared_hidden else None,
            "n_group": moe.n_group, "topk_group": moe.topk_group, "routed_scaling_factor": moe.routed_scaling,
            "first_k_dense_replace": moe.layers.index(True) if True in moe.layers else cfg.n_layers,
            "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "norm_topk_prob": True})
    return out


def llada_moe_from_hf(data: dict[str, Any], source: str) -> ModelConfig:
    """LLaDA-MoE (``model_type: llada`` with ``num_experts``): fields as its config class names them."""
    _require(data, source, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts",
                            "num_experts_per_tok", "expert_intermediate_size"))
    _refuse(data, source, ("tie_word_embeddings", "rope_scaling"), "LLaDA-MoE")
    layers, heads, hidden = int(data["num_hidden_layers"]), int(data["num_attention_heads"]), int(data["hidden_size"])
    get = data.get
    freq = get("moe_layer_freq") or [1] * layers
    if len(freq) != layers:
        raise ModelLoadError(f"{source}: moe_layer_freq has {len(freq)} entries for {layers} layers")
    shared = get("shared_expert_intermediate_size")
    expert_hidden = int(data["expert_intermediate_size"])
    dense = int(get("dense_intermediate_size") or -1)
    if dense <= 0:
        if not all(freq):
            raise ModelLoadError(f"{source}: dense layers need dense_intermediate_size")
        dense = expert_hidden  # no dense layer: the value is never used
    factor = float(get("partial_rotary_factor", 1.0))
    moe = MoEConfig(n_experts=int(data["num_experts"]), top_k=int(data["num_experts_per_tok"]),
                    expert_hidden=expert_hidden, layers=tuple(bool(f) for f in freq),
                    shared_hidden=int(shared) if shared and int(shared) > 0 else None, router="softmax",
                    expert_bias=bool(get("moe_router_enable_expert_bias")))
    return ModelConfig(
        d_model=hidden, n_layers=layers, n_heads=heads, n_kv_heads=int(get("num_key_value_heads") or heads),
        mlp_hidden_size=dense, vocab_size=int(data["vocab_size"]), rope_theta=float(get("rope_theta", 10000.0)),
        max_sequence_length=int(get("max_position_embeddings", 4096)), rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
        mask_token_id=_first_id(get("mask_token_id"), LING_MASK_ID),
        eos_token_id=_first_id(get("eos_token_id"), LING_EOS_ID), pad_token_id=_first_id(get("pad_token_id"), 1),
        bos_token_id=get("bos_token_id"), eot_token_id=None, family="llada_moe",
        partial_rotary_factor=factor if factor > 0 else 1.0, qk_norm=bool(get("qk_layernorm")),
        attention_bias=bool(get("attention_bias")), clip_qkv=get("clip_qkv"), moe=moe)


def llada_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    assert moe is not None
    return {
        "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "dense_intermediate_size": cfg.mlp_hidden_size, "expert_intermediate_size": moe.expert_hidden,
        "shared_expert_intermediate_size": moe.shared_hidden, "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k, "moe_layer_freq": [int(m) for m in moe.layers],
        "moe_router_enable_expert_bias": moe.expert_bias, "moe_router_score_function": "softmax",
        "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor,
        "max_position_embeddings": cfg.max_sequence_length, "rms_norm_eps": cfg.rms_norm_eps,
        "qk_layernorm": cfg.qk_norm, "attention_bias": cfg.attention_bias, "clip_qkv": cfg.clip_qkv,
        "hidden_act": "silu", "tie_word_embeddings": False, "mask_token_id": cfg.mask_token_id,
        "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id, "torch_dtype": "bfloat16",
    }


def diffusion_gemma_config(cfg: DiffusionGemmaConfig) -> ModelConfig:
    """DiffusionGemma's own config as the ``ModelConfig`` the rest of maskkv reads: the geometry of its sliding
    layers (the per-layer truth stays in ``family_config``), the window its positions allow, and its special ids.
    It has no mask token: the pad id stands in where the rest of the code skips never-written positions (a
    finished answer is padded after its end-of-sequence id). Its EOS ids are all stop ids."""
    eos = cfg.eos_token_ids or (1,)
    return ModelConfig(
        d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, mlp_hidden_size=cfg.mlp_hidden_size,
        vocab_size=cfg.vocab_size, n_kv_heads=cfg.n_kv_heads, head_dim_override=cfg.head_dim,
        rope_theta=cfg.rope_sliding.theta, max_sequence_length=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, mask_token_id=cfg.pad_token_id, eos_token_id=eos[0],
        pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eot_token_id=None, family="diffusion_gemma",
        qk_norm=True, stop_token_ids=tuple(eos), family_config=cfg)


def diffusion_gemma_from_hf(data: dict[str, Any], source: str) -> ModelConfig:
    """DiffusionGemma's ``config.json`` (both layouts: ``models.diffusion_gemma_config.from_hf``)."""
    return diffusion_gemma_config(diffusion_gemma_config_from_hf(data, source))


def diffusion_gemma_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.family_config is None:
        raise ValueError("not a DiffusionGemma config")
    return diffusion_gemma_config_to_hf(cfg.family_config)


_LING = dict(mask_token_id=LING_MASK_ID, eos_token_id=LING_EOS_ID, pad_token_id=LING_EOS_ID, bos_token_id=None,
             eot_token_id=None)
_DREAM = dict(family="dream", logit_shift=1, rope_theta=1e6, rms_norm_eps=1e-6)

NAMED_CONFIGS: dict[str, ModelConfig] = {
    # The real LLaDA-8B shape (Instruct, Base and 1.5 share it).
    "llada-8b": ModelConfig(d_model=4096, n_layers=32, n_heads=32, mlp_hidden_size=12288, vocab_size=126464),
    # Same structure, scaled down for CPU benchmarks.
    "llada-small": ModelConfig(d_model=1024, n_layers=8, n_heads=16, mlp_hidden_size=3072, vocab_size=126464),
    # For tests: special ids fit a small vocabulary.
    "tiny": ModelConfig(
        d_model=64, n_layers=2, n_heads=4, mlp_hidden_size=128, vocab_size=512, rope_theta=10000.0,
        max_sequence_length=1024, mask_token_id=5, eos_token_id=1, pad_token_id=1, bos_token_id=0,
        eot_token_id=2,
    ),
    # Dream-v0-Instruct-7B (Qwen2.5-7B layout, bidirectional, GQA 28/4).
    "dream-7b": ModelConfig(
        d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, mlp_hidden_size=18944, vocab_size=152064,
        max_sequence_length=2048, mask_token_id=151666, eos_token_id=151643, pad_token_id=151643,
        bos_token_id=151643, eot_token_id=151645, **_DREAM,  # type: ignore[arg-type]
    ),
    "dream-tiny": ModelConfig(
        d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=128, vocab_size=512,
        max_sequence_length=1024, mask_token_id=5, eos_token_id=1, pad_token_id=1, bos_token_id=0, eot_token_id=2,
        **_DREAM,  # type: ignore[arg-type]
    ),
    # LLaDA2.0-mini / 2.1-mini (16B, 1.4B active) and -flash (100B): config.json values (docs/models.md).
    "llada2-mini": ModelConfig(
        d_model=2048, n_layers=20, n_heads=16, n_kv_heads=4, mlp_hidden_size=5120, vocab_size=157184,
        rope_theta=600000.0, max_sequence_length=32768, rms_norm_eps=1e-6, **_LING,  # type: ignore[arg-type]
        family="llada2", head_dim_override=128, partial_rotary_factor=0.5, qk_norm=True, attention="block_causal",
        moe=MoEConfig(256, 8, 512, (False,) + (True,) * 19, shared_hidden=512, n_group=8, topk_group=4,
                      routed_scaling=2.5)),
    "llada2-flash": ModelConfig(
        d_model=4096, n_layers=32, n_heads=32, n_kv_heads=4, mlp_hidden_size=9216, vocab_size=157184,
        rope_theta=600000.0, max_sequence_length=32768, rms_norm_eps=1e-6, **_LING,  # type: ignore[arg-type]
        family="llada2", head_dim_override=128, partial_rotary_factor=0.5, qk_norm=True, attention="block_causal",
        moe=MoEConfig(256, 8, 1024, (False,) + (True,) * 31, shared_hidden=1024, n_group=8, topk_group=4,
                      routed_scaling=2.5)),
    # LLaDA-MoE-7B-A1B: its config.json values were not read (docs/models.md marks them unconfirmed).
    "llada-moe-7b": ModelConfig(
        d_model=2048, n_layers=16, n_heads=16, mlp_hidden_size=1024, vocab_size=157184, rope_theta=50000.0,
        max_sequence_length=8192, **_LING, family="llada_moe", qk_norm=True,  # type: ignore[arg-type]
        moe=MoEConfig(64, 8, 1024, (True,) * 16, router="softmax", expert_bias=False)),
    # LLaDA2.0-mini's shape with 32 of its 256 experts per MoE layer: every token does the mini's work (8 routed
    # experts and the shared one, the same attention), in 11.4 GB of fp32 weights instead of 65 GB (CPU benchmarks)
    "llada2-mini-32e": ModelConfig(
        d_model=2048, n_layers=20, n_heads=16, n_kv_heads=4, mlp_hidden_size=5120, vocab_size=157184,
        rope_theta=600000.0, max_sequence_length=32768, rms_norm_eps=1e-6, **_LING,  # type: ignore[arg-type]
        family="llada2", head_dim_override=128, partial_rotary_factor=0.5, qk_norm=True, attention="block_causal",
        moe=MoEConfig(32, 8, 512, (False,) + (True,) * 19, shared_hidden=512, n_group=8, topk_group=4,
                      routed_scaling=2.5)),
    # LLaDA2's structure at a size the CPU benchmarks can run (8 layers, 32 experts): speed ratios, not quality.
    "llada2-small": ModelConfig(
        d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, mlp_hidden_size=2816, vocab_size=157184,
        rope_theta=600000.0, max_sequence_length=32768, rms_norm_eps=1e-6, **_LING,  # type: ignore[arg-type]
        family="llada2", head_dim_override=64, partial_rotary_factor=0.5, qk_norm=True, attention="block_causal",
        moe=MoEConfig(32, 4, 512, (False,) + (True,) * 7, shared_hidden=512, n_group=4, topk_group=2,
                      routed_scaling=2.5)),
    # For tests: the same structures, tiny.
    "llada2-tiny": ModelConfig(
        d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden_size=96, vocab_size=512, rope_theta=10000.0,
        max_sequence_length=1024, rms_norm_eps=1e-6, mask_token_id=5, eos_token_id=1, pad_token_id=1,
        bos_token_id=None, eot_token_id=None, family="llada2", head_dim_override=16, partial_rotary_factor=0.5,
        qk_norm=True, attention="block_causal",
        moe=MoEConfig(8, 2, 32, (False, True, True), shared_hidden=32, n_group=4, topk_group=2, routed_scaling=2.5)),
    "llada-moe-tiny": ModelConfig(
        d_model=64, n_layers=2, n_heads=4, mlp_hidden_size=96, vocab_size=512, rope_theta=10000.0,
        max_sequence_length=1024, mask_token_id=5, eos_token_id=1, pad_token_id=1, bos_token_id=None,
        eot_token_id=None, family="llada_moe", partial_rotary_factor=0.5, qk_norm=True,
        moe=MoEConfig(8, 2, 32, (False, True), shared_hidden=32, router="softmax", expert_bias=True)),
}


def named_config(name: str) -> ModelConfig:
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise UsageError(f"unknown model config {name!r}; choose one of: {', '.join(NAMED_CONFIGS)}") from None


# ----- maskkv's own defaults stored with a model (the ``maskkv`` section of its generation_config.json) ---------
GENERATION_KEYS = ("gen_length", "steps", "block_length")
SAMPLER_KEYS = ("threshold", "editing_threshold", "max_post_steps")
# DiffusionGemma's sampler settings as transformers writes them in generation_config.json (top level; the entropy
# bound inside ``sampler_config``)
DENOISING_KEYS = ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold")


@dataclass(frozen=True)
class ModelDefaults:
    """What a model folder says about how to run it (the embedded model's short answers and lead summaries)."""

    generation: dict[str, int] = field(default_factory=dict)  # gen_length / steps / block_length
    summary_length: int | None = None  # tokens of the lead summary the model was trained to write
    summary_block: int | None = None  # the block length its summaries were trained to be decoded in
    # LLaDA2's sampler settings as the checkpoint's generation_config.json gives them (top level, or under
    # ``maskkv``): threshold, editing_threshold (LLaDA2.1's token editing), max_post_steps
    sampler: dict[str, float] = field(default_factory=dict)
    # DiffusionGemma's: ``DENOISING_KEYS`` and ``entropy_bound``, as far as the generation config gives them (its EOS
    # and pad ids reach the model's config: ``models.loading.read_config``)
    denoising: dict[str, Any] = field(default_factory=dict)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _denoising(data: dict[str, Any]) -> dict[str, Any]:
    """DiffusionGemma's sampler settings of a generation config (``ModelDefaults.denoising``)."""
    out: dict[str, Any] = {k: data[k] for k in DENOISING_KEYS if _number(data.get(k))}
    sampler = data.get("sampler_config")
    if isinstance(sampler, dict) and _number(sampler.get("entropy_bound")):
        out["entropy_bound"] = sampler["entropy_bound"]
    return out


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_model_defaults(folder: Path) -> ModelDefaults:
    """The defaults in ``folder/generation_config.json``, read once: lengths and summary settings from its ``maskkv``
    section, sampler settings from that section or else the file's top level, the denoising settings from the top
    level; empty defaults when the file is missing or unreadable."""
    try:
        data = json.loads((folder / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ModelDefaults()
    if not isinstance(data, dict):
        return ModelDefaults()
    section = data.get("maskkv")
    section = section if isinstance(section, dict) else {}
    sampler = {k: float(v) for k in SAMPLER_KEYS for v in (section.get(k, data.get(k)),)
               if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0}
    generation = {k: v for k in GENERATION_KEYS if (v := _positive(section.get(k))) is not None}
    return ModelDefaults(generation, _positive(section.get("summary_length")),
                         _positive(section.get("summary_block_length")), sampler, _denoising(data))
