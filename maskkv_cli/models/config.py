"""Model configuration: one frozen dataclass, named sizes, and the `config.json` mapping."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
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
    family: str = "llada"

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
        if self.n_kv_heads != self.n_heads:
            raise UsageError("LLaDA models have as many key/value heads as query heads (no GQA)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    # ----- config.json in the upstream LLaDA format -------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["LLaDAModelLM"],
            "model_type": "llada",
            "d_model": self.d_model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "mlp_hidden_size": self.mlp_hidden_size,
            "mlp_ratio": max(1, self.mlp_hidden_size // self.d_model),
            "vocab_size": self.vocab_size,
            "embedding_size": self.embedding_size,
            "rope": True,
            "rope_theta": self.rope_theta,
            "rope_full_precision": True,
            "max_sequence_length": self.max_sequence_length,
            "rms_norm_eps": self.rms_norm_eps,
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
            "mask_token_id": self.mask_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eot_token_id": self.eot_token_id,
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = str(data.get("model_type", "")).lower()
        if model_type and model_type != "llada":
            raise ModelLoadError(
                f"{source}: model_type {data.get('model_type')!r} is not supported yet (supported: 'llada')"
            )
        missing = [k for k in ("d_model", "n_layers", "n_heads", "vocab_size") if k not in data]
        if missing:
            raise ModelLoadError(f"{source}: missing required fields {', '.join(missing)}")
        mlp = data.get("mlp_hidden_size") or data["d_model"] * int(data.get("mlp_ratio", 4))
        for flag in ("alibi", "include_bias", "include_qkv_bias", "weight_tying", "scale_logits"):
            if data.get(flag):
                raise ModelLoadError(f"{source}: {flag}=true is not supported by this LLaDA implementation")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known and v is not None}
        kwargs["mlp_hidden_size"] = int(mlp)
        kwargs.pop("family", None)
        return cls(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
}


def named_config(name: str) -> ModelConfig:
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise UsageError(f"unknown model config {name!r}; choose one of: {', '.join(NAMED_CONFIGS)}") from None
