"""A loaded model and tokenizer, and one call that turns a question into an answer with run statistics."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from maskkv_cli.app import arguments
from maskkv_cli.app.run_settings import family_defaults
from maskkv_cli.engine.batch_memory import auto_batch_size, batch_memory, free_bytes, model_geometry
from maskkv_cli.engine.batch_work import batch_work
from maskkv_cli.engine.plan import CacheConfig, CachePlan, ImportanceChoice, importance_choice, plan_cache
from maskkv_cli.engine.prefill import join_rows
from maskkv_cli.engine.prefix import compute_prefix
from maskkv_cli.errors import UsageError
from maskkv_cli.kv.prefix import PrefixStore
from maskkv_cli.models.catalog import is_embedded_model
from maskkv_cli.models.checkpoint import ModelFolder
from maskkv_cli.models.families import family
from maskkv_cli.models.loading import load_checkpoint
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.policies.base import get_policy
from maskkv_cli.prompting import chat_prompt_ids, decode_answer, document_question, stop_ids
from maskkv_cli.prompting.chat import text_ids, tokenizer_from_folder, use_chat_format
from maskkv_cli.prompting.fit import FittedContext, rope_scale_factor
from maskkv_cli.sampling import DreamOptions, Event, GenerationConfig, GenerationResult, SamplerOptions, sample
from maskkv_cli.sampling.confidence import Confidence, answer_confidence
from maskkv_cli.sampling.diffusion_gemma import diffusion_gemma_defaults
from maskkv_cli.sampling.llada2 import llada2_defaults
from maskkv_cli.sampling.service import GenerationService
from maskkv_cli.sampling.stream import BatchJob, sample_many

DOCUMENTS_REMEMBERED = 4  # documents whose token ids a session keeps (``Session.document_ids``)
OVERHEADS_KEPT = 4096  # questions whose prompt overhead a session keeps (``Session.prompt_overhead``)


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

    def __init__(self, model_path: str | os.PathLike[str] | ModelFolder, device: str = "cpu",
                 dtype: str | None = None, device_map: str | None = None, dream: DreamOptions | None = None,
                 quantize: str | None = None) -> None:
        """``model_path``: a checkpoint folder or ORG/NAME (resolved here), or the ``ModelFolder`` a command
        resolved at its edge (nothing is resolved again). ``quantize``: "int8" or "int4" weights of the linear
        layers and experts, quantized as they are read (``models/quantize.py``); None or "none": as stored."""
        from maskkv_cli.models.placement import parse_device_map, place_model
        from maskkv_cli.models.quantize import QuantizeError, check_mode

        folder = ModelFolder.of(model_path)
        quantize = check_mode(quantize)
        if device_map and not family(folder.config.family).device_map:
            raise UsageError(f"--device-map: a {folder.config.family} model cannot be spread over devices yet; "
                             "load it on one device (--device)")
        layer_devices = parse_device_map(device_map, folder.config.n_layers)
        if layer_devices and quantize:
            raise QuantizeError(f"--quantize {quantize} with --device-map is not supported (each layer is packed "
                                "for the device it is read on); run on one device, or leave --quantize out")
        from maskkv_cli.runtime.devices import resolve_device

        self.device = layer_devices[0] if layer_devices else torch.device(resolve_device(str(device)))
        load_on = "cpu" if layer_devices else self.device
        self.model: DiffusionLM = load_checkpoint(folder.path, folder.config, device=load_on, dtype=dtype or
                                                  ("bf16" if self.device.type == "cuda" else None), quantize=quantize,
                                                  prequantized=folder.prequantized)
        if layer_devices:
            place_model(self.model, layer_devices)
        self.init_text_side(folder, dream)

    def init_text_side(self, folder: ModelFolder, dream: DreamOptions | None = None) -> None:
        """What a session knows besides the weights: the checkpoint (``folder``; its cache plans look the
        calibration profile up by it), tokenizer, RoPE base, the model's stored defaults (read once from
        ``generation_config.json``), Dream's options, the documents' token ids. A session that plans without
        weights (``batch.cells.PlanningSession``) sets up only this."""
        config = folder.config
        self.folder = folder
        self.model_path = folder.name  # what the outputs call the model (as given)
        self.tokenizer: Any = use_chat_format(tokenizer_from_folder(folder.path), family(config.family).chat_format)
        self.base_theta = config.rope_theta
        self.dream = dream or DreamOptions()  # Dream's own sampler settings; LLaDA's loop has none
        defaults = folder.defaults
        self.generation_defaults = family_defaults(defaults.generation, config.family)
        self.summary_length = defaults.summary_length
        self.summary_block = defaults.summary_block
        stored = str(folder.path / "generation_config.json")  # (named by a refusal of its settings)
        self.llada2 = llada2_defaults(defaults.sampler, stored)  # LLaDA2's sampler settings (its loop only reads them)
        self.stored_llada2 = self.llada2  # the model's own (``generation_config.json``), what options go over
        # DiffusionGemma's: its schedule from generation_config.json, and the cache of its last document's prefix
        self.diffusion_gemma = diffusion_gemma_defaults(defaults.denoising, stored)
        self.stored_diffusion_gemma = self.diffusion_gemma
        self._documents: dict[str, list[int]] = {}  # text -> token ids (``document_ids``), oldest first
        self._probes: dict[str, list[int]] = {}  # the last document's empty-question prompt (``document_prompt_len``)
        self._overheads: dict[str, int] = {}  # ``prompt_overhead`` per question (a job asks it 3-4 times)
        self._prefix: tuple[tuple[object, ...], PrefixStore] | None = None  # the last computed document prefix
        self._lock = threading.Lock()  # the remembered documents, for sessions shared by threads (a server)
        # Where generations run: None, here; a ``GenerationService``, in its thread with the other threads' ones
        # (``maskkv serve`` with a batch size above 1).
        self.engine: GenerationService | None = None

    @functools.cached_property
    def embedded(self) -> bool:
        """Whether the model is the tiny one shipped in the package (``models.catalog.is_embedded_model``), resolved
        once: what the empty-answer note says depends on it."""
        return is_embedded_model(self.model_path)

    @property
    def window(self) -> int:
        """The model's training window in tokens (``max_sequence_length``)."""
        return self.model.config.max_sequence_length

    def response_positions(self, gen_length: int) -> int:
        """Positions a response of ``gen_length`` tokens takes after its prompt: DiffusionGemma generates whole
        canvases (``gen_length`` rounded up to its canvas length), the other families ``gen_length``."""
        gemma = self.model.config.family_config
        if gemma is None:
            return gen_length
        return -(-gen_length // gemma.canvas_length) * gemma.canvas_length

    def longest_answer(self, positions: int) -> int:
        """The most new tokens whose response takes at most ``positions`` positions (0 if none fits)."""
        gemma = self.model.config.family_config
        if gemma is None:
            return max(0, positions)
        return max(0, positions // gemma.canvas_length * gemma.canvas_length)

    def count_tokens(self, text: str) -> int:
        return len(text_ids(self.tokenizer, text))

    def document_ids(self, text: str) -> list[int]:
        """Token ids of a document (no special tokens), remembered for the last few documents: ``ask -q`` with
        several questions, ``profile`` with several runs and ``batch`` encode each document once."""
        with self._lock:
            ids = self._documents.get(text)
        if ids is None:
            ids = text_ids(self.tokenizer, text)
            with self._lock:
                self._documents[text] = ids
                while len(self._documents) > DOCUMENTS_REMEMBERED:
                    del self._documents[next(iter(self._documents))]
        return ids

    def document_prompt_len(self, document: str, ids: list[int]) -> int:
        """How many leading ``ids`` (a prompt about ``document``) are the template's start and the document: the
        ids they share with the prompt of an empty question (encoded once per document)."""
        probe = self._probes.get(document)
        if probe is None:
            probe = self.prompt_ids(document_question(document, ""))
            self._probes = {document: probe}  # the last document's
        return next((i for i, (a, b) in enumerate(zip(ids, probe, strict=False)) if a != b), min(len(ids), len(probe)))

    def prefix_store(self, ids: list[int], block: int, rope_factor: float = 1.0) -> PrefixStore:
        """The computed prefix ``ids`` of a block-causal model (``engine/prefix.py``), kept for the next question
        about the same document (one at a time: it holds a layer's worth of activations per token)."""
        key = (tuple(ids), block, rope_factor)
        with self._lock:
            if self._prefix is None or self._prefix[0] != key:
                self._prefix = None  # free the last one before computing the next
                self._prefix = (key, compute_prefix(self.model, ids, block, rope_factor=rope_factor))
            return self._prefix[1]

    def prompt_overhead(self, question: str) -> int:
        """Tokens of the chat template and the question around an empty document."""
        n = self._overheads.get(question)
        if n is None:
            n = len(chat_prompt_ids(self.tokenizer, document_question("", question)))
            if len(self._overheads) >= OVERHEADS_KEPT:
                self._overheads.clear()
            self._overheads[question] = n
        return n

    def prompt_ids(self, text: str) -> list[int]:
        return chat_prompt_ids(self.tokenizer, text)

    def answer_ids(
        self,
        ids: list[int],
        gen: GenerationConfig,
        cache: CacheConfig,
        on_event: Callable[[Event], None] | None = None,
        document_len: int = 0,
        rope_factor: float = 1.0,
    ) -> Answer:
        """Answer the prompt ``ids``. ``document_len``: its leading ids that are a document's (``pipeline.prepare``):
        a block-causal model computes that document's whole blocks once for every question asked of it, DiffusionGemma
        its encoder's cache of them (``sampling.diffusion_gemma.DocumentCache``).
        ``rope_factor``: the prompt's RoPE base scaling (``--long rope-scale``); a prompt past the window needs at
        least the factor LongLLaDA's rule gives its length (``check_window``)."""
        self.check_prompt("Session.answer_ids", ids, gen, cache, rope_factor)
        plan = self._plan(ids, gen, cache, document_len, rope_factor)
        prompt = torch.tensor([ids], dtype=torch.long, device=self.device)
        if self.engine is not None:
            result = self.engine.generate(prompt, gen, plan, on_event, self.sampler_options())
        else:
            result = sample(self.model, prompt, gen, plan, on_event, dream=self.dream, llada2=self.llada2,
                            diffusion_gemma=self.diffusion_gemma)
        return self._answer(ids, plan, result)

    def answer_many(self, prompts: Sequence[list[int]], gen: GenerationConfig, cache: CacheConfig,
                    batch_size: int = 1, on_answer: Callable[[int, Answer], None] | None = None,
                    document_lens: Sequence[int] | None = None,
                    rope_factors: Sequence[float] | None = None) -> list[Answer]:
        """Answer every prompt, up to ``batch_size`` of them denoised together (``sampling/stream.py``); each
        answer is the one ``answer_ids`` gives it alone (with its ``document_lens`` and ``rope_factors``, as there).
        ``on_answer(i, answer)`` as each finishes."""
        n = len(prompts)
        doc_lens = list(document_lens) if document_lens is not None else [0] * n
        factors = list(rope_factors) if rope_factors is not None else [1.0] * n
        if len(doc_lens) != n or len(factors) != n:  # (zip's "argument 2 is shorter than argument 1")
            raise UsageError(f"Session.answer_many: {n} prompts take as many document_lens and rope_factors, got "
                             f"{len(doc_lens)} and {len(factors)}")
        batch_size = arguments.batch_size("Session.answer_many", batch_size)
        for ids, factor in zip(prompts, factors, strict=True):
            self.check_prompt("Session.answer_many", ids, gen, cache, factor)
        choice = importance_choice(self.folder, cache)  # the calibration profile looked up once for them all
        plans = [self._plan(list(ids), gen, cache, doc, f, choice) for ids, doc, f in zip(prompts, doc_lens, factors,
                                                                                           strict=True)]
        jobs = [BatchJob(torch.tensor([ids], dtype=torch.long, device=self.device), gen, plan)
                for ids, plan in zip(prompts, plans, strict=True)]
        done: dict[int, Answer] = {}

        def finished(i: int, result: GenerationResult) -> None:
            done[i] = self._answer(list(prompts[i]), plans[i], result)
            if on_answer is not None:
                on_answer(i, done[i])

        sample_many(self.model, jobs, batch_size, self.sampler_options(), on_result=finished)
        return [done[i] for i in range(n)]

    def batch_size(self, requested: int | None, prompt_lens: Sequence[int], gen: GenerationConfig,
                   cache: CacheConfig, work_lens: Sequence[int] | None = None) -> tuple[int, str | None]:
        """``requested`` sequences at once, or for None (``--batch-size auto``) the largest batch of prompts of
        ``prompt_lens`` that fits the device's free memory by the memory model (``engine/batch_memory.py``), with a
        line saying so; 1 when the prompts that will run (``work_lens``, where known) leave a batch too little of
        their work to share (``engine/batch_work.py``)."""
        if requested is not None:
            return requested, None
        if not prompt_lens:
            return 1, None
        longest = max(prompt_lens)
        plan = plan_cache(self.model, cache, longest, self.folder, block_length=gen.block_length)
        kept = plan.budget if plan.policy.evicts and plan.budget is not None else longest
        element = torch.finfo(self.model.dtype).bits // 8
        memory = batch_memory(model_geometry(self.model), longest, gen.gen_length, kept, element)
        size, line = auto_batch_size(memory, free_bytes(self.device), len(prompt_lens))
        name = self.model.config.family
        if size > 1 and not family(name).engine_lanes:
            return 1, (f"batch size auto: 1 ({name} runs each prompt's passes alone, so a batch would gain nothing and "
                       f"a document's stored cache would not be reused; by the memory model {size} would fit)")
        if size > 1 and work_lens:
            block_causal = self.model.config.block_causal
            step_rows = gen.block_length if block_causal else self.response_positions(gen.gen_length)
            work = batch_work(work_lens, gen.steps, step_rows, plan.policy.uses_cache, join_rows(self.model))
            if not work.pays:
                return 1, f"batch size auto: 1 ({work.reason()}; by the memory model {size} would fit)"
        return size, line

    def sampler_options(self) -> SamplerOptions:
        """Every family's own sampler settings as this session holds them (its loop reads its own)."""
        return SamplerOptions(self.dream, self.llada2, self.diffusion_gemma)

    def prefix_rows(self, document_len: int, prompt_len: int, gen: GenerationConfig, cache: CacheConfig) -> int:
        """The rows of a prompt whose document (its first ``document_len`` tokens) is computed once and stored for
        every prompt that starts with it: the document's whole blocks, on a block-causal model with a policy that
        caches; else 0."""
        if not (self.model.config.block_causal and get_policy(cache.policy).uses_cache):
            return 0
        return min(document_len, prompt_len) // gen.block_length * gen.block_length

    def _plan(self, ids: list[int], gen: GenerationConfig, cache: CacheConfig, document_len: int = 0,
              rope_factor: float = 1.0, importance: ImportanceChoice | None = None) -> CachePlan:
        block = gen.block_length
        prefix = None
        whole = self.prefix_rows(document_len, len(ids), gen, cache)
        if whole:
            prefix = self.prefix_store(ids[:whole], block, rope_factor)
        return plan_cache(self.model, cache, len(ids), self.folder, block_length=block, prefix=prefix,
                          rope_factor=rope_factor, document_len=document_len, importance=importance)

    def _answer(self, ids: list[int], plan: CachePlan, result: GenerationResult) -> Answer:
        """The answer to ``ids`` from its generation: text, confidence, the plan's note."""
        cfg = self.model.config
        tokens = result.tokens[0].tolist()
        stops = stop_ids(self.tokenizer, cfg)
        text = decode_answer(self.tokenizer, tokens, stops, cfg.mask_token_id)
        confidence = None
        if result.token_probs is not None:
            confidence = answer_confidence(tokens, result.token_probs[0].tolist(), stops, cfg.mask_token_id)
        notes = [plan.note] if plan.note else []
        return Answer(text, len(ids), plan.budget if plan.policy.evicts else None, result, notes, confidence)

    def answer(self, question: str, gen: GenerationConfig, cache: CacheConfig,
               on_event: Callable[[Event], None] | None = None) -> Answer:
        """The answer to a plain prompt (the chat template around ``question``), which must fit the window with the
        answer's positions (a document is fitted by ``pipeline.ask`` instead)."""
        arguments.require("Session.answer", "question", question, str, "a str")
        arguments.require("Session.answer", "gen", gen, GenerationConfig, "a GenerationConfig")
        if not question.strip():
            raise UsageError("Session.answer: the question is empty")
        ids = self.prompt_ids(question)
        self.check_window(len(ids), gen.gen_length, reach=False)  # a plain prompt is never RoPE-scaled
        return self.answer_ids(ids, gen, cache, on_event)

    def check_prompt(self, where: str, ids: Sequence[int], gen: GenerationConfig, cache: CacheConfig,
                     rope_factor: float = 1.0) -> None:
        """Refuse what ``answer_ids`` cannot answer (``app/arguments.py``): ids that are no tokens of the model,
        settings of the wrong kind, a prompt past the window (``check_window``)."""
        arguments.token_ids(where, ids, self.model.config.vocab_size)
        arguments.require(where, "gen", gen, GenerationConfig, "a GenerationConfig")
        arguments.require(where, "cache", cache, CacheConfig, "a CacheConfig")
        arguments.rope_factor(where, rope_factor)
        self.check_window(len(ids), gen.gen_length, rope_factor)

    def check_window(self, prompt_len: int, gen_length: int, rope_factor: float = 1.0, reach: bool = True) -> None:
        """Refuse a prompt of ``prompt_len`` tokens that, with the positions of an answer of ``gen_length`` tokens,
        runs past the model's window (``reach`` False), or (``reach``) further than its RoPE factor reaches: the
        factor LongLLaDA's rule gives that length (``--long rope-scale``'s; 1 up to a few times the window) is the
        least it needs. Positions the model cannot tell apart give garbage without a word."""
        answer = self.response_positions(gen_length)
        total = prompt_len + answer
        if total <= self.window:
            return
        if reach and rope_factor >= rope_scale_factor(self.model.config.head_dim, self.base_theta, self.window, total):
            return
        most = self.longest_answer(self.window - prompt_len)
        hint = (f"ask for at most {most} new tokens, or shorten the prompt" if most > 0 else
                "shorten the prompt (maskkv ask reads a document of any length)")
        raise UsageError(f"the prompt ({prompt_len} tokens) and an answer of {answer} tokens take {total} of the "
                         f"model's {self.window}-token window: {hint}")
