"""Model families: the one table from a family to its module class, its ``config.json`` mapping and its sampler.

A new bidirectional family is its model file (blocks on ``models.base.DiffusionBlock``, the model on
``DiffusionModel``; see ``models.protocol``), its ``config.json`` readers in ``config.py`` and one ``Family`` row
here. Everything else (loading, saving, ``maskkv models``, the sampler choice) reads this table.

DiffusionGemma is not built on that base (an encoder and a decoder over one set of layers, no mask token): its row
names its own loader and sampler, and what of the shared machinery it does not take (a device map).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from maskkv_cli.errors import ModelLoadError, UsageError
from maskkv_cli.models.config import (
    ModelConfig,
    diffusion_gemma_from_hf,
    diffusion_gemma_to_hf,
    dream_from_hf,
    dream_to_hf,
    llada2_from_hf,
    llada2_to_hf,
    llada_from_hf,
    llada_moe_from_hf,
    llada_moe_to_hf,
    llada_to_hf,
)
from maskkv_cli.models.diffusion_gemma import DiffusionGemma
from maskkv_cli.models.dream import Dream
from maskkv_cli.models.llada import LLaDA
from maskkv_cli.models.llada2 import LLaDA2
from maskkv_cli.models.llada_moe import LLaDAMoE
from maskkv_cli.models.meta import meta_device
from maskkv_cli.models.protocol import DiffusionLM

__all__ = ["FAMILY_TABLE", "DiffusionLM", "Family", "build_model", "config_from_hf", "config_to_hf", "family",
           "parameter_shapes"]


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    model_class: type[nn.Module]
    # the denoising loop (``sampling.SAMPLERS``): "llada" (semi-autoregressive blocks over a bidirectional
    # model), "dream" (one block, its rules), "llada2" (block diffusion: block-causal, threshold commits, editing),
    # "diffusion_gemma" (canvas after canvas over a causal encoder's cache, uniform-noise denoising)
    sampler: str
    model_types: tuple[str, ...]  # ``config.json`` ``model_type`` values (lower case) this family reads
    from_hf: Callable[[dict[str, Any], str], ModelConfig]  # config.json -> ModelConfig
    to_hf: Callable[[ModelConfig], dict[str, Any]]  # ModelConfig -> config.json
    chat_format: str = "llada"  # the chat template when the tokenizer has none (``prompting.chat.TEMPLATES``)
    claims: Callable[[dict[str, Any]], bool] = lambda data: True  # among families sharing a model_type: this one?
    # how its checkpoint is read (``models.loading.LOADERS``): "standard" (every parameter under its one key) or
    # the family's own ("diffusion_gemma": tied weights stored under either side, buffers, a vision tower skipped)
    loader: str = "standard"
    # whether a document's prompt prefix is computed once for every question about it (``pipeline.prepare`` then
    # says how many leading ids are the document's): a block-causal model's whole blocks, a causal encoder's cache
    document_prefix: bool = False
    device_map: bool = True  # whether ``--device-map`` can spread its layers over devices
    # the run settings (``app.run_settings.RunSettings`` fields) its sampler does not take: given, they are refused
    refuses: tuple[str, ...] = ()
    # the cache policies its prompt cache cannot run (``--policy``): refused where a command meets its model
    refuses_policies: tuple[str, ...] = ()
    # run settings' values its sampler cannot run, by setting: refused where a command meets its model
    refuses_values: tuple[tuple[str, str], ...] = ()
    # whether its passes run as the engine's lanes (``engine/prefill.py``, ``engine/step.py``), joined with other
    # prompts' in a batch; False (its own forward): each prompt runs alone, in turn, so ``--batch-size auto`` runs
    # one at a time and ``bench memory``, which measures the engine's prefill, refuses it
    engine_lanes: bool = True

    @property
    def one_block(self) -> bool:
        """Whether its sampler answers in one block (it has no ``--block-length``: Dream's, DiffusionGemma's)."""
        return "block_length" in self.refuses


def _has_experts(data: dict[str, Any]) -> bool:
    return bool(data.get("num_experts")) and int(data["num_experts"]) > 0


# The run settings each sampler has no use for (``Family.refuses``): LLaDA's block loop takes no token filter,
# Dream's confidence rule or LLaDA2.1's editing; Dream's loop is one block with its own confidence rule (no
# guidance, remasking choice or commit threshold); LLaDA2's takes a threshold and token filters but no guidance,
# remasking choice or Dream's rule.
LLADA_REFUSES = ("alg", "top_p", "top_k", "editing_threshold", "max_post_steps")
DREAM_REFUSES = ("block_length", "cfg_scale", "remasking", "threshold", "editing_threshold", "max_post_steps")
LLADA2_REFUSES = ("cfg_scale", "remasking", "alg")

# Order matters where model_types overlap: LLaDA-MoE (``llada`` with experts) is tried before LLaDA-8B.
FAMILY_TABLE: dict[str, Family] = {
    "llada_moe": Family("llada_moe", LLaDAMoE, "llada", ("llada", "lladamoe"), llada_moe_from_hf, llada_moe_to_hf,
                        chat_format="ling", claims=_has_experts, refuses=LLADA_REFUSES),
    "llada": Family("llada", LLaDA, "llada", ("llada", ""), llada_from_hf, llada_to_hf, refuses=LLADA_REFUSES),
    "dream": Family("dream", Dream, "dream", ("dream",), dream_from_hf, dream_to_hf, chat_format="chatml",
                    refuses=DREAM_REFUSES),
    "llada2": Family("llada2", LLaDA2, "llada2", ("llada2_moe",), llada2_from_hf, llada2_to_hf, chat_format="ling",
                     document_prefix=True, refuses=LLADA2_REFUSES),
    "diffusion_gemma": Family("diffusion_gemma", DiffusionGemma, "diffusion_gemma", ("diffusion_gemma",),
                              diffusion_gemma_from_hf, diffusion_gemma_to_hf, chat_format="gemma",
                              loader="diffusion_gemma", document_prefix=True, device_map=False, engine_lanes=False,
                              refuses=("steps", "block_length", "cfg_scale", "remasking", "threshold", "alg", "top_p",
                                       "top_k", "editing_threshold", "max_post_steps"),
                              # residual entries are not ported to its cache; only the window's encoder queries vote
                              refuses_policies=("maskkv-plus", "maskkv-residual", "prompt-vote", "all-vote"),
                              # layer importance measured online needs the engine's prefill, which it does not run;
                              # its two RoPE kinds are not scaled
                              refuses_values=(("layer_budgets", "online"), ("long", "rope-scale"))),
}


def family(name: str) -> Family:
    try:
        return FAMILY_TABLE[name]
    except KeyError:
        raise UsageError(f"unknown model family {name!r} (known: {', '.join(FAMILY_TABLE)})") from None


def config_from_hf(data: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A ``config.json`` in a family's upstream format (chosen by ``model_type``) as a ``ModelConfig``."""
    model_type = str(data.get("model_type", "")).lower()
    for fam in FAMILY_TABLE.values():
        if model_type in fam.model_types and fam.claims(data):
            return fam.from_hf(data, source)
    supported = ", ".join(dict.fromkeys(repr(t) for fam in FAMILY_TABLE.values() for t in fam.model_types if t))
    raise ModelLoadError(f"{source}: model_type {data.get('model_type')!r} is not supported (supported: {supported})")


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` in its family's upstream format."""
    return family(cfg.family).to_hf(cfg)


def build_model(cfg: ModelConfig) -> DiffusionLM:
    return family(cfg.family).model_class(cfg)  # type: ignore[return-value]


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape, computed from the config alone (no tensors are allocated)."""
    with meta_device():
        model = build_model(cfg)
    return {model.checkpoint_key(name): tuple(p.shape) for name, p in model.named_parameters()}  # type: ignore[attr-defined]
