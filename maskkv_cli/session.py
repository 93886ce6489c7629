"""A loaded model and tokenizer, and one call that turns a question into an answer with run statistics."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from maskkv_cli.defaults import DEFAULT_BUDGET, DEFAULT_POLICY
from maskkv_cli.kv.budgets import resolve_budget
from maskkv_cli.models.loading import load_model, resolve_model_path
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.policies.base import PolicyOptions, get_policy
from maskkv_cli.prompting import chat_prompt_ids, decode_answer, document_question, load_tokenizer, stop_ids
from maskkv_cli.prompting.fit import FittedContext
from maskkv_cli.sampling import DreamOptions, Event, GenerationConfig, GenerationResult, sample
from maskkv_cli.sampling.confidence import Confidence, answer_confidence


@dataclass(frozen=True)
class CacheConfig:
    policy: str = DEFAULT_POLICY
    budget: int | None = None
    ratio: float | None = None
    options: PolicyOptions = PolicyOptions()
    layer_budgets: str = "auto"  # MaskKV: auto (calibration profile if any), online, uniform

    def resolved_budget(self, prompt_len: int) -> int | None:
        """Budget in entries per head per layer; None keeps the whole prompt."""
        if self.budget is None and self.ratio is None:
            return None
        return resolve_budget(self.budget, self.ratio, prompt_len)


GENERATION_KEYS = ("gen_length", "steps", "block_length")


def _maskkv_section(folder: Path) -> dict[str, Any]:
    """The ``maskkv`` section of a model's ``generation_config.json``; empty when there is none or it is unreadable."""
    try:
        data = json.loads((folder / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    section = data.get("maskkv") if isinstance(data, dict) else None
    return section if isinstance(section, dict) else {}


def read_generation_defaults(folder: Path) -> dict[str, int]:
    """``maskkv`` defaults stored in a model's ``generation_config.json`` (e.g. the tiny model's short answers)."""
    section = _maskkv_section(folder)
    return {k: int(v) for k, v in section.items() if k in GENERATION_KEYS and isinstance(v, int) and v > 0}


def resolve_generation(defaults: dict[str, int], gen_length: int | None, steps: int | None,
                       block_length: int | None) -> tuple[int, int, int]:
    """(gen_length, steps, block_length) from the options, filling gaps from the model's defaults
    (``read_generation_defaults``), else 128 / gen length / 32: what every command and a batch job use."""
    gen = gen_length or defaults.get("gen_length", 128)
    block = block_length or defaults.get("block_length", min(32, gen))
    if block_length is None and gen % block:
        block = gen
    n_steps = steps or (defaults.get("steps", gen) if gen_length is None else gen)
    return gen, n_steps, block


def _maskkv_count(folder: Path, key: str) -> int | None:
    """A positive integer ``key`` of the ``maskkv`` section of a model's ``generation_config.json``, else None."""
    value = _maskkv_section(folder).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_summary_length(folder: Path) -> int | None:
    """Tokens of the lead summary a model was trained to write (``maskkv.summary_length`` in its
    ``generation_config.json``, the embedded model's), or None for a model without that format."""
    return _maskkv_count(folder, "summary_length")


def read_summary_block(folder: Path) -> int | None:
    """The block length a model's lead summaries were trained to be decoded in (``maskkv.summary_block_length``;
    ``train-tiny --summary-block``), or None: the whole summary is one block."""
    return _maskkv_count(folder, "summary_block_length")


@dataclass
class Answer:
    text: str
    prompt_len: int
    budget: int | None
    result: GenerationResult
    notes: list[str] = field(default_factory=list)
    confidence: Confidence | None = None  # mean/min probability of the answer's tokens when unmasked
    fitted: FittedContext | None = None  # how the document was fitted to the window (``pipeline.ask``)


class Session:
    """Model + tokenizer loaded once; ``answer`` may be called many times."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str | None = None,
                 device_map: str | None = None, dream: DreamOptions | None = None) -> None:
        from maskkv_cli.models.loading import read_config
        from maskkv_cli.models.placement import parse_device_map, place_model

        self.model_path = model_path
        folder = resolve_model_path(model_path)
        layer_devices = parse_device_map(device_map, read_config(folder).n_layers)
        self.device = layer_devices[0] if layer_devices else torch.device(device)
        load_on = "cpu" if layer_devices else self.device
        self.model: DiffusionLM = load_model(model_path, device=load_on, dtype=dtype or
                                             ("bf16" if self.device.type == "cuda" else None))
        if layer_devices:
            place_model(self.model, layer_devices)
        self.tokenizer: Any = load_tokenizer(model_path)
        self.base_theta = self.model.config.rope_theta
        self.dream = dream or DreamOptions()  # Dream's own sampler settings; LLaDA's loop has none
        self.generation_defaults = read_generation_defaults(folder)
        self.summary_length = read_summary_length(folder)
        self.summary_block = read_summary_block(folder)

    @property
    def window(self) -> int:
        """The model's training window in tokens (``max_sequence_length``)."""
        return self.model.config.max_sequence_length

    def set_rope_factor(self, factor: int) -> None:
        """Scale the RoPE base (NTK-style) by ``factor`` relative to the checkpoint's; 1 restores it."""
        self.model.config = self.model.config.with_(rope_theta=self.base_theta * factor)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_overhead(self, question: str) -> int:
        """Tokens of the chat template and the question around an empty document."""
        return len(chat_prompt_ids(self.tokenizer, document_question("", question)))

    def prompt_ids(self, text: str) -> list[int]:
        return chat_prompt_ids(self.tokenizer, text)

    def answer_ids(
        self,
        ids: list[int],
        gen: GenerationConfig,
        cache: CacheConfig,
        on_event: Callable[[Event], None] | None = None,
    ) -> Answer:
        from maskkv_cli.policies.calibration import resolve_importance

        budget = cache.resolved_budget(len(ids))
        options, note = resolve_importance(self.model_path, cache.options, cache.policy, cache.layer_budgets)
        policy = get_policy(cache.policy, options)
        if budget is None and policy.evicts:
            budget = DEFAULT_BUDGET
        evicting = policy.evicts and budget is not None and budget < len(ids)
        online = cache.layer_budgets == "online" and policy.uses_importance
        prompt = torch.tensor([ids], dtype=torch.long, device=self.device)
        result = sample(self.model, prompt, gen, policy, budget, on_event, online_importance=online,
                        dream=self.dream)
        cfg = self.model.config
        tokens = result.tokens[0].tolist()
        stops = stop_ids(self.tokenizer, cfg)
        text = decode_answer(self.tokenizer, tokens, stops, cfg.mask_token_id)
        confidence = None
        if result.token_probs is not None:
            confidence = answer_confidence(tokens, result.token_probs[0].tolist(), stops, cfg.mask_token_id)
        notes = [note] if note and evicting else []
        return Answer(text, len(ids), budget if policy.evicts else None, result, notes, confidence)

    def answer(self, question: str, gen: GenerationConfig, cache: CacheConfig,
               on_event: Callable[[Event], None] | None = None) -> Answer:
        return self.answer_ids(self.prompt_ids(question), gen, cache, on_event)
