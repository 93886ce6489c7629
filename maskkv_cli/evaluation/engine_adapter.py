"""The one place the harness model touches maskkv's engine.

Everything the evaluation package needs from maskkv (load a model, answer a prompt under a cache policy, score
tokens with the bidirectional forward) goes through the functions here. The harness builds each prompt itself
(its task templates, its chat-template switch), so ``answer`` starts from prompt ids: it calls
``Session.answer_ids``, the sampling half of ``maskkv_cli.app.pipeline.ask`` (which fits a document and builds
maskkv's own prompt first), as ``bench quality`` does for prompts it has already built. ``answer_many`` answers
prompts of one answer length and temperature in batches through ``Session.answer_many``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from maskkv_cli.prompting.fit import middle_cut
from maskkv_cli.runtime.devices import resolve_device

if TYPE_CHECKING:
    from maskkv_cli.app.run_settings import RunSettings
    from maskkv_cli.app.session import Answer
    from maskkv_cli.sampling.llada import GenerationConfig


# Blocks of 32 when they divide a request's answer length and no block length is given: applied to the answer's
# generation settings, not set as a run setting, so that a family whose sampler takes no blocks (Dream) is not
# refused an option nobody gave.
HARNESS_BLOCK = 32
PER_REQUEST = ("gen_length", "temperature")  # each request's own (``max_gen_toks``, ``do_sample`` + temperature)
ALIASES = {"cfg": "cfg_scale"}  # the harness's name for a setting


def harness_settings(args: dict[str, Any]) -> RunSettings:
    """The run settings of the harness's model args: every shared run setting (``run_settings.RunSettings``: the
    cache policy, budget or ratio, layer budgets, steps, block length, sampler options, LLaDA2's
    ``editing_threshold`` and ``max_post_steps``, seed) by its name (``cfg`` for ``cfg_scale``), as text or a
    value; the answer length and the temperature are each request's own."""
    from maskkv_cli.app.run_settings import RunSettings
    from maskkv_cli.errors import UsageError

    given = {ALIASES.get(name, name): value for name, value in args.items() if value is not None}
    per_request = sorted(set(given) & set(PER_REQUEST))
    if per_request:
        raise UsageError(f"{', '.join(per_request)}: set by each request (max_gen_toks, do_sample and temperature), "
                         "not a maskkv model arg")
    return RunSettings.from_values(given, "maskkv model arg")


def request_run(settings: RunSettings, temperature: float) -> RunSettings:
    """``settings`` with a request's temperature."""
    return replace(settings, temperature=temperature)


def request_generation(run: RunSettings, gen_length: int) -> GenerationConfig:
    """A request's generation settings: ``gen_length`` tokens, one per step unless ``steps`` is set, in blocks of
    the run's block length, else of ``HARNESS_BLOCK``, where that divides the length, else one block."""
    return run.answer_generation(gen_length, HARNESS_BLOCK)


@dataclass
class Reply:
    """An answer's text (up to its end-of-text token, stripped) and what running it cost."""

    text: str
    prompt_tokens: int  # after fitting the window
    truncated: bool  # the prompt's middle was cut to fit the window
    stats: dict[str, Any]


class Engine:
    """A loaded model and tokenizer with the few facts the harness model needs."""

    def __init__(self, model: str | None, device: str = "auto", dtype: str | None = None,
                 settings: RunSettings | None = None, quantize: str = "none") -> None:
        """``settings``: the run's; its sampler options (Dream's, LLaDA2's over the model's stored defaults) are
        set on the session once, as ``maskkv ask`` does from its options. ``quantize``: the weights' (none, int8,
        int4)."""
        from maskkv_cli.app.session import Session
        from maskkv_cli.models.catalog import default_model

        path, self.note, known = default_model(model)
        self.session = Session(known or path, device=resolve_device(device), dtype=dtype, quantize=quantize)
        if settings is not None:
            self.session.dream = settings.dream()
            self.session.llada2 = settings.llada2(self.session.stored_llada2)
            settings.check_family(self.session.model.config.family)
        cfg = self.session.model.config
        self.path = path
        self.tokenizer: Any = self.session.tokenizer
        self.window: int = self.session.window
        self.bos_id: int | None = cfg.bos_token_id
        self.mask_id: int = cfg.mask_token_id
        self.family: str = cfg.family
        self.block_causal: bool = cfg.block_causal  # LLaDA2: a document shared with the request before runs once
        self.device: torch.device = self.session.device
        self.last_ids: list[int] = []  # the previous request's prompt (its shared start is a document, see answer)

    def chat_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Messages rendered with the model's chat template (LLaDA's when the tokenizer has none)."""
        from maskkv_cli.prompting import llada_template

        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        return llada_template(messages, add_generation_prompt)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Bidirectional forward over ``ids`` (B, T): logits (B, T, V) predicting each position (Dream's shift
        applied), no cache involved."""
        with torch.no_grad():
            return self.session.model(ids.to(self.device))


def batch_size_arg(value: Any) -> int | None:
    """The ``batch_size`` model arg: a positive number, or None for ``auto`` (also the harness's ``auto:N``, whose
    repeated tuning one memory-model estimate per group of requests stands in for)."""
    from maskkv_cli.engine.batch_memory import parse_batch_size
    from maskkv_cli.errors import UsageError

    if value is None or str(value).strip().lower().startswith("auto"):
        return None
    try:
        return parse_batch_size(str(value))
    except UsageError:
        raise UsageError(f"batch_size must be a positive number or auto, got {value!r}") from None


def fit_prompt(engine: Engine, ids: list[int], gen_length: int) -> tuple[list[int], bool]:
    """The prompt ``ids`` fitted to the window with room for ``gen_length`` answer tokens (LongBench's middle cut
    when it is too long), and whether it was cut."""
    room = engine.window - engine.session.response_positions(gen_length)
    if room <= 0:
        from maskkv_cli.errors import UsageError

        raise UsageError(f"max_gen_toks {gen_length} leaves no room for a prompt in the model's "
                         f"{engine.window}-token window")
    return middle_cut(ids, room), len(ids) > room


def reply_of(result: Answer, prompt_tokens: int, truncated: bool) -> Reply:
    """A session's answer as the harness model's reply: its text and its run's statistics."""
    run = result.result.stats
    stats = {
        "budget": result.budget,
        "kv_entries": run.kv_entries,
        "kv_bytes": run.kv_bytes,
        "kv_full_bytes": run.kv_full_bytes,
        "compression": round(run.compression, 4),
        "prefill_s": round(run.prefill_s, 6),
        "median_step_s": round(run.median_step_s, 6),
        "steps": run.steps_run,
        "total_s": round(run.total_s, 6),
        "gen_tokens": run.gen_length,
    }
    return Reply(result.text, prompt_tokens, truncated, stats)


def shared_start(ids: Sequence[int], before: Sequence[int]) -> int:
    """How many leading ids ``ids`` shares with the prompt ``before`` (a block-causal model computes that start's
    whole blocks once: the harness asks a document's questions one after another)."""
    return next((i for i, (a, b) in enumerate(zip(ids, before, strict=False)) if a != b), min(len(ids), len(before)))


def answer(engine: Engine, ids: list[int], gen_length: int, settings: RunSettings,
           temperature: float = 0.0) -> Reply:
    """Generate up to ``gen_length`` tokens after the prompt ``ids`` under the settings' cache policy.

    The answer length is ``gen_length``, in blocks as ``request_generation`` says (as ``bench quality`` does for
    LongBench's answer lengths); steps default to one token per step.
    """
    ids, cut = fit_prompt(engine, ids, gen_length)
    run = request_run(settings, temperature)
    gen, cache = request_generation(run, gen_length), run.cache()
    # A block-causal model computes the start this prompt shares with the previous one once: the split depends on
    # the order of the requests, so an answer may differ from the same request alone by rounding, not by what is
    # computed.
    shared = shared_start(ids, engine.last_ids)
    engine.last_ids = list(ids)
    return reply_of(engine.session.answer_ids(ids, gen, cache, document_len=shared), len(ids), cut)


def batch_size(engine: Engine, prompts: Sequence[list[int]], gen_length: int, settings: RunSettings,
               temperature: float = 0.0, requested: int | None = None,
               max_batch_size: int | None = None) -> tuple[int, str | None]:
    """How many of these prompts (one answer length and temperature) ``answer_many`` denoises together:
    ``requested``, or for None the most that fit free memory by the memory model (``Session.batch_size``), at most
    ``max_batch_size``; with the line saying how an automatic size was chosen."""
    run = request_run(settings, temperature)
    lengths = [len(fit_prompt(engine, list(ids), gen_length)[0]) for ids in prompts]
    size, note = engine.session.batch_size(requested, lengths, request_generation(run, gen_length), run.cache(),
                                           work_lens=lengths)
    if requested is None and max_batch_size is not None and size > max_batch_size:
        size, note = max_batch_size, f"{note}; capped at max_batch_size {max_batch_size}"
    return size, note


def answer_many(engine: Engine, prompts: Sequence[list[int]], gen_length: int, settings: RunSettings,
                temperature: float = 0.0, batch_size: int = 1,
                on_answer: Callable[[int, Reply], None] | None = None) -> list[Reply]:
    """``answer`` for every prompt (one answer length and temperature), up to ``batch_size`` of them denoised
    together (``Session.answer_many``), every family alike; each reply is the one ``answer`` gives its prompt
    after the prompt before it (a block-causal model computes the start a prompt shares with the one before
    once: ``document_lens``). Replies in the prompts' order; ``on_answer(i, reply)`` as each finishes."""
    fitted = [fit_prompt(engine, list(ids), gen_length) for ids in prompts]
    shared = [shared_start(ids, fitted[i - 1][0] if i else engine.last_ids) for i, (ids, _) in enumerate(fitted)]
    if fitted:
        engine.last_ids = list(fitted[-1][0])
    run = request_run(settings, temperature)
    gen, cache = request_generation(run, gen_length), run.cache()
    replies: dict[int, Reply] = {}

    def finished(i: int, result: Answer) -> None:
        ids, cut = fitted[i]
        replies[i] = reply_of(result, len(ids), cut)
        if on_answer is not None:
            on_answer(i, replies[i])

    engine.session.answer_many([ids for ids, _ in fitted], gen, cache, batch_size, on_answer=finished,
                               document_lens=shared)
    return [replies[i] for i in range(len(fitted))]
