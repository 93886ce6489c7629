"""Model configuration: one frozen dataclass, named sizes, and each family's `config.json` mapping."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from maskkv_cli.errors import ModelLoadError, UsageError


@dataclass(frozen=True)
class ModelConfig:
    """Shape and special tokens of a LLaDA-style masked diffusion transformer."""

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

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.embedding_size is None:
            object.__setattr__(self, "embedding_size", self.vocab_size)
        for name in ("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise UsageError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise UsageError(f"model config: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise UsageError(f"model config: head dim {self.head_dim} must be even for RoPE")
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
        return self.d_model // self.n_heads

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
}


def named_config(name: str) -> ModelConfig:
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise UsageError(f"unknown model config {name!r}; choose one of: {', '.join(NAMED_CONFIGS)}") from None


# ----- maskkv's own defaults stored with a model (the ``maskkv`` section of its generation_config.json) ---------
GENERATION_KEYS = ("gen_length", "steps", "block_length")


@dataclass(frozen=True)
class ModelDefaults:
    """What a model folder says about how to run it (the embedded model's short answers and lead summaries)."""

    generation: dict[str, int] = field(default_factory=dict)  # gen_length / steps / block_length
    summary_length: int | None = None  # tokens of the lead summary the model was trained to write
    summary_block: int | None = None  # the block length its summaries were trained to be decoded in


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_model_defaults(folder: Path) -> ModelDefaults:
    """The ``maskkv`` section of ``folder/generation_config.json``, read once; empty defaults when there is none
    or it is unreadable."""
    try:
        data = json.loads((folder / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ModelDefaults()
    section = data.get("maskkv") if isinstance(data, dict) else None
    if not isinstance(section, dict):
        return ModelDefaults()
    generation = {k: v for k in GENERATION_KEYS if (v := _positive(section.get(k))) is not None}
    return ModelDefaults(generation, _positive(section.get("summary_length")),
                         _positive(section.get("summary_block_length")))
