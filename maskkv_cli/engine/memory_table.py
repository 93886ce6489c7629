"""What fits where: the memory model's table over context lengths, weight formats and cache policies (``maskkv
plan``), from a model's config alone (no weights are read).

Each row is one sequence of ``context`` tokens (the prompt and the response it is generated with) in one weight
format, with the full prompt cache or MaskKV's at a budget: the weights (``models/weights_estimate.py``) plus the
peak of ``engine/batch_memory.py``'s model for a batch of one (the cache the steps keep, the cache at the peak and
the activations there), and whether it fits each GPU size with ``RESERVE`` bytes left for the CUDA context and
kernel workspaces. Everything here is an estimate from the shapes; ``docs/performance.md`` works one row of each
model out by hand.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from maskkv_cli.engine.batch_memory import batch_memory, config_geometry
from maskkv_cli.errors import ModelLoadError, UsageError, reason

if TYPE_CHECKING:
    from maskkv_cli.models.config import ModelConfig
    from maskkv_cli.models.diffusion_gemma_config import DiffusionGemmaConfig

__all__ = ["FORMATS", "GPU_SIZES_GIB", "RESERVE", "PlanModel", "PlanRow", "memory_table", "resolve_plan_model",
           "row_dict"]

GIB = 1 << 30
GPU_SIZES_GIB = (16, 24, 32, 80)
RESERVE = GIB  # left on a GPU for the CUDA context, cuBLAS / attention workspaces and allocator slack
# weight format -> (quantization of models/quantize.py, bytes per value of everything unquantized: the rest of the
# weights, the cache and the activations)
FORMATS: dict[str, tuple[str | None, int]] = {"bf16": (None, 2), "fp16": (None, 2), "fp32": (None, 4),
                                              "int8": ("int8", 2), "int4": ("int4", 2)}


@dataclass(frozen=True)
class PlanModel:
    """A model's config as ``--model`` named it: a named config, or a folder's (or cached ORG/NAME's) config.json."""

    name: str
    config: ModelConfig | DiffusionGemmaConfig
    source: str  # "named config" or the folder

    @property
    def family(self) -> str:
        return str(getattr(self.config, "family", "diffusion_gemma"))

    @property
    def max_positions(self) -> int:
        cfg = self.config
        return int(getattr(cfg, "max_position_embeddings", None) or cfg.max_sequence_length)  # type: ignore[union-attr]

    def default_gen_length(self) -> int:
        """DiffusionGemma: one canvas; the other families: 128 tokens (the commands' default)."""
        return int(getattr(self.config, "canvas_length", 128))


def resolve_plan_model(name: str) -> PlanModel:
    """``name`` as a named config of any family (``models/config.py``, ``models/diffusion_gemma_config.py``), else a
    checkpoint folder or an ORG/NAME in the local Hugging Face cache whose config.json is read (never the weights)."""
    from maskkv_cli.models import config as configs
    from maskkv_cli.models import diffusion_gemma_config as dgemma

    if name in configs.NAMED_CONFIGS:
        return PlanModel(name, configs.NAMED_CONFIGS[name], "named config")
    if name in dgemma.NAMED_CONFIGS:
        return PlanModel(name, dgemma.NAMED_CONFIGS[name], "named config")
    from maskkv_cli.paths import resolve_model_path

    try:
        folder = resolve_model_path(name)
    except ModelLoadError as exc:
        names = ", ".join([*configs.NAMED_CONFIGS, *dgemma.NAMED_CONFIGS])
        raise UsageError(f"{exc}; --model also takes a named config: {names}") from None
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {reason(exc)}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    if data.get("model_type") == "diffusion_gemma":
        return PlanModel(name, dgemma.from_hf(data, str(path)), str(folder))
    from maskkv_cli.models.families import config_from_hf

    return PlanModel(name, config_from_hf(data, str(path)), str(folder))


@dataclass(frozen=True)
class PlanRow:
    """One sequence of ``context`` tokens in one weight format under one cache policy (bytes)."""

    context: int  # prompt + response tokens
    prompt: int
    gen_length: int
    format: str  # a key of FORMATS
    policy: str  # "full" or "maskkv"
    budget: int | None  # entries kept per KV head per evicted layer; None: the full cache
    weights: int
    cache_kept: int  # the prompt cache the denoising steps hold
    cache_peak: int  # the prompt cache at the peak (DiffusionGemma: before the first step cuts it, every full layer
    # whole, or one beside the others' kept entries where it is encoded layer by layer)
    activations: int  # the rest of the peak above the weights
    total: int  # weights + cache at the peak + activations
    fits: dict[str, bool]  # GPU size in GiB -> total + RESERVE fits
    weights_implemented: bool  # False: maskkv cannot load the model in this format yet (the rules' estimate)
    over_window: bool  # the context exceeds the model's positions
    terms: dict[str, int]  # the memory model's parts (engine/batch_memory.py)


def parse_formats(values: list[str]) -> list[str]:
    unknown = [v for v in values if v not in FORMATS]
    if unknown:
        hint = " (unquantized weights are named by their dtype, e.g. bf16)" if unknown[0] == "none" else ""
        raise UsageError(f"unknown weight format {unknown[0]!r}; choose from {', '.join(FORMATS)}{hint}")
    return values


def memory_table(model: PlanModel, contexts: list[int], formats: list[str], budgets: list[int],
                 gen_length: int | None = None, gpu_sizes: tuple[int, ...] = GPU_SIZES_GIB) -> list[PlanRow]:
    """A row per context, format and cache policy (full, then MaskKV at each budget), in that order."""
    from maskkv_cli.models.weights_estimate import weights_estimate

    parse_formats(formats)
    gen = model.default_gen_length() if gen_length is None else gen_length
    if gen <= 0 or any(b <= 0 for b in budgets):
        raise UsageError("--gen-length and --budgets must be positive")
    short = [c for c in contexts if c <= gen]
    if short:
        raise UsageError(f"context {short[0]} leaves no prompt beside the {gen}-token response; give a longer "
                         "--context or a shorter --gen-length")
    geometry = config_geometry(model.config)
    rows = []
    for fmt in formats:
        mode, element = FORMATS[fmt]
        weights = weights_estimate(model.config, mode, element)
        for context in contexts:
            prompt = context - gen
            for policy, budget in [("full", None), *(("maskkv", b) for b in budgets)]:
                kept = prompt if budget is None else min(budget, prompt)
                memory = batch_memory(geometry, prompt, gen, kept, element)
                excess = memory.terms.get("full cache before the cut", 0)
                above = memory.total(1)
                total = weights.total_bytes + above
                fits = {str(size): total + RESERVE <= size * GIB for size in gpu_sizes}
                rows.append(PlanRow(context, prompt, gen, fmt, policy, budget, weights.total_bytes,
                                    memory.cache_per_sequence, memory.cache_per_sequence + excess,
                                    above - memory.cache_per_sequence - excess, total, fits, weights.implemented,
                                    context > model.max_positions, dict(memory.terms)))
    return rows


def row_dict(row: PlanRow) -> dict[str, Any]:
    return asdict(row)
