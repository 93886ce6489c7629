"""DiffusionGemma's generations in the one driver: its sampler loop, its forward and its run statistics.

The sampler is ``diffusion_gemma_steps.denoising_loop`` (transformers' ``generate``, canvas after canvas, its random
draws in transformers' order). ``diffusion_gemma_loop`` hands each of its requests to the driver as a
``GemmaStep``; the forward (``GemmaForward``) answers it alone (DiffusionGemma's layers are not the engine's
blocks, so no generation shares a forward with another): a decoder pass over the prompt cache, or a finished
canvas joining the cache. The prompt cache is run as the ``CachePlan`` says:

- a caching policy (``full``, ``maskkv``, the baselines): the encoder's cache of the prompt, cut at the first
  decoder pass by the policy at the plan's budget on the full-attention layers (``diffusion_gemma_kv``;
  ``full`` or a budget at least the prompt keeps it whole);
- ``none``: no prompt cache: the prompt and the canvases committed so far are encoded again before every decoder
  pass. The encoder is causal, so that gives exactly the cached numbers (the same chunks, the same arithmetic).

The prompt is always encoded in the same chunks: the document's leading ids (``CachePlan.document_len``), then the
rest. With a ``DocumentCache`` the first chunk is computed once per document and reused for every question about it,
so an answer is the same whether its document's cache was reused or computed for it.

Settings (``DiffusionGemmaOptions``, the model's ``generation_config.json``, and the shared ``GenerationConfig``):
``gen_length`` is ``max_new_tokens`` (rounded up to whole canvases, as transformers returns them); temperature 0
(the default) is transformers' deterministic limit (``t_min`` 0, ``t_max`` 1e-6: every draw the argmax, every
position accepted), a temperature T > 0 the model's linear schedule scaled to start at T (the released schedule
0.8 -> 0.4 is ``--temperature 0.8``); ``seed`` seeds the generator that draws the canvases (on the CPU the numbers
``torch.manual_seed(seed)`` gives transformers). Options of the other samplers are refused (``Family.refuses``,
checked where a command meets its model; ``--cfg``, ``--remasking`` and ``--threshold`` here too).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.selection import LayerRecord
from maskkv_cli.errors import ModelLoadError, UsageError
from maskkv_cli.models.diffusion_gemma import DiffusionGemma, PromptCache
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.models.quantize import held_bytes, quantization_of
from maskkv_cli.runtime.stats import RunStats, model_devices, now, peak_memory, reset_cuda_peaks
from maskkv_cli.sampling.common import Event, GenerationResult
from maskkv_cli.sampling.diffusion_gemma_forward import CompressingForward
from maskkv_cli.sampling.diffusion_gemma_kv import Compression, EncodedPrompt, encode_prompt
from maskkv_cli.sampling.diffusion_gemma_steps import (
    CommitRequest,
    DecodeRequest,
    DiffusionGemmaSampling,
    LoopOutput,
    denoising_loop,
)
from maskkv_cli.sampling.driver import Loop
from maskkv_cli.sampling.forward import Forward, Lane, StepRequest
from maskkv_cli.sampling.llada import GenerationConfig

DETERMINISTIC_T_MAX = 1e-6  # with t_min 0: transformers' deterministic limit (``--temperature 0``)


class DocumentCache:
    """The encoder's cache of the last document prefix one model computed (one at a time: it holds the prefix's keys
    and values in every layer), for every question about that document; shared by threads (a server)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[tuple[tuple[int, ...], int], EncodedPrompt] | None = None
        self.computed = 0  # document prefixes encoded so far (a reused one is not counted again)

    def get(self, model: DiffusionGemma, ids: Sequence[int], window: int) -> EncodedPrompt:
        """``encode_prompt`` of the document's leading ``ids`` with ``window`` queries kept, computed the first time
        they are asked for."""
        key = (tuple(ids), window)
        with self._lock:
            if self._entry is None or self._entry[0] != key:
                self._entry = None  # free the last one before computing the next
                prefix = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
                self._entry = (key, encode_prompt(model, prefix, window))
                self.computed += 1
            return self._entry[1]

    def stored_bytes(self) -> int:
        """Bytes the kept document prefix holds (its cache on every layer and the window queries)."""
        with self._lock:
            if self._entry is None:
                return 0
            encoded = self._entry[1]
            return cache_size(encoded.cache)[1] + sum(q.nbytes for q in encoded.window_queries.values())


@dataclass(frozen=True)
class DiffusionGemmaOptions:
    """DiffusionGemma's own sampler settings beside the shared ``GenerationConfig``: the model's schedule and
    stopping rule (its ``generation_config.json``; transformers' defaults where it is silent), the EOS and pad ids
    (None: the model config's, which has the generation config's), and where document prefixes are kept (None:
    computed for each prompt)."""

    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability_threshold: int | None = 1
    confidence_threshold: float | None = 0.005
    eos_token_ids: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    documents: DocumentCache | None = field(default=None, compare=False)


def diffusion_gemma_defaults(stored: dict[str, Any], source: str = "generation_config.json") -> DiffusionGemmaOptions:
    """The options a checkpoint's generation_config.json sets (``models.config.ModelDefaults.denoising``), with a
    document cache of their own; settings the sampler cannot take are refused naming the file (``source``)."""
    known = {k: stored[k] for k in ("max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold",
                                    "confidence_threshold") if k in stored}
    for k in ("max_denoising_steps", "stability_threshold"):
        if k in known:
            known[k] = int(known[k])
    try:  # checked now, by the sampler's own rules, not at the first answer
        DiffusionGemmaSampling(**known)
    except UsageError as exc:
        raise ModelLoadError(f"{source}: {exc}; fix or remove it") from None
    return DiffusionGemmaOptions(**known, documents=DocumentCache())


def sampling_settings(gen: GenerationConfig, options: DiffusionGemmaOptions, eos: Sequence[int],
                      pad: int) -> DiffusionGemmaSampling:
    """The sampler's settings for one generation (see the module doc); ``eos`` and ``pad``: the model config's ids,
    used where the options have none."""
    refused = ["--cfg"] if gen.cfg_scale else []
    refused += ["--remasking"] if gen.remasking != "low_confidence" else []
    refused += ["--threshold"] if gen.threshold is not None else []
    if refused:
        what = "is not an option" if len(refused) == 1 else "are not options"
        raise UsageError(f"{', '.join(refused)} {what} of the diffusion_gemma sampler (docs/models.md has what "
                         "it takes)")
    schedule = DiffusionGemmaSampling(
        max_new_tokens=gen.gen_length, max_denoising_steps=options.max_denoising_steps, t_min=options.t_min,
        t_max=options.t_max, entropy_bound=options.entropy_bound, stability_threshold=options.stability_threshold,
        confidence_threshold=options.confidence_threshold,
        eos_token_ids=tuple(options.eos_token_ids if options.eos_token_ids is not None else eos),
        pad_token_id=options.pad_token_id if options.pad_token_id is not None else pad)
    if gen.temperature == 0:
        return replace(schedule, t_min=0.0, t_max=DETERMINISTIC_T_MAX)
    return replace(schedule, t_max=gen.temperature, t_min=gen.temperature * options.t_min / options.t_max)


# ----- the forward ---------------------------------------------------------------------------------------------------

NO_ROWS = torch.empty(0, dtype=torch.long)
NO_LOGITS = torch.empty(0)  # what a commit sends back (the loop needs nothing)


@dataclass(frozen=True)
class GemmaStep(StepRequest):
    """One request of DiffusionGemma's loop as the driver carries it (``x``: the prompt, on the model's device)."""

    request: DecodeRequest | CommitRequest | None = None


class GemmaForward(Forward):
    """Answers a generation's requests alone, its prompt cache run as the plan says (see the module doc)."""

    def __init__(self, model: DiffusionGemma, plan: CachePlan, prompt: Tensor,
                 documents: DocumentCache | None, canvases: int = 1) -> None:
        """``canvases``: how many the generation may run; a cache the plan keeps whole keeps room on its full
        layers for all but the last canvas to join it and for the decoder's canvas, so that neither copies it (a
        cache the first step cuts needs none)."""
        super().__init__(model, plan)  # type: ignore[arg-type]
        self.gemma_model, self.prompt, self.documents = model, prompt, documents
        self.spare = 0 if plan.evicts else canvases * model.gemma.canvas_length
        d = plan.document_len if 0 < plan.document_len < prompt.shape[1] else 0
        self.document_len = d
        # policy none: what is encoded again before each decoder pass, in the chunks the cached run encodes
        self.chunks: list[Tensor] = [prompt[:, :d], prompt[:, d:]] if d else [prompt]
        self.inner: CompressingForward | None = None
        self.compression: Compression | None = None
        self.kv_entries = self.kv_bytes = 0

    def lane(self, request: StepRequest) -> Lane | None:
        return None

    def document_prefix(self) -> EncodedPrompt | None:
        """The document's chunk through the encoder, from the document cache (computed there the first time its
        document is asked about); None without one."""
        if not self.document_len or self.documents is None:
            return None
        doc = self.prompt[0, : self.document_len].tolist()
        return self.documents.get(self.gemma_model, doc, self.policy.options.window)

    @torch.no_grad()
    def alone(self, request: StepRequest) -> Tensor:
        assert isinstance(request, GemmaStep) and request.request is not None
        asked = request.request
        if not self.policy.uses_cache:
            return self.recompute(asked)
        if self.inner is None:
            budget = self.plan.budget if self.plan.budget is not None else self.prompt_len
            self.inner = CompressingForward(self.gemma_model, self.prompt, self.policy, budget,
                                            prefix=self.document_prefix(), split=self.document_len, spare=self.spare)
        out = self.inner(asked)
        if self.compression is None and self.inner.compression is not None:  # the prompt cache as it stays
            self.compression = self.inner.compression
            assert self.inner.cache is not None  # the cut cache, set with the compression
            self.kv_entries, self.kv_bytes = cache_size(self.inner.cache)
        return NO_LOGITS if out is None else out

    def recompute(self, asked: DecodeRequest | CommitRequest) -> Tensor:
        """Policy ``none``: a commit is remembered, a decoder pass encodes everything before it first."""
        if isinstance(asked, CommitRequest):
            self.chunks.append(asked.tokens)
            return NO_LOGITS
        cache: PromptCache | None = None
        left = sum(chunk.shape[1] for chunk in self.chunks)
        for chunk in self.chunks:  # the first one's store keeps room for the rest and the canvas: no copies
            left -= chunk.shape[1]
            cache = self.gemma_model.encode(chunk, cache, spare=left + asked.canvas.shape[1]).cache
        assert cache is not None
        return self.gemma_model.decode(asked.canvas, cache, asked.self_conditioning)

    def layer_records(self) -> tuple[list[LayerRecord], list[int] | None]:
        """Per full layer what the policy kept (every prompt entry when nothing was evicted), and the layer budgets
        of an evicting run."""
        c = self.compression
        if c is None:
            return [], None
        if c.evicted:
            records = [LayerRecord(ch.layer, ch.layer_budget, ch.head_budgets, ch.preference, ch.positions)
                       for ch in c.choices]
            return records, list(c.layer_budgets or ())
        m, b = self.prompt_len, self.prompt.shape[0]
        return [LayerRecord(i, m, torch.full((b, self.gemma_model.gemma.layer(i).n_kv_heads), m), None, None)
                for i in self.gemma_model.gemma.full_layers], None


def cache_size(cache: PromptCache) -> tuple[int, int]:
    """(logical prompt entries over layers, heads and batch, bytes of its slots) of a prompt cache: a compressed
    layer's padding slots count, the room a store keeps for the canvases to come does not."""
    entries = nbytes = 0
    for kv in cache:
        b, h, t, _ = kv.keys.shape
        entries += b * h * t if kv.kept is None else int(kv.kept.sum())
        nbytes += kv.keys.nbytes + kv.values.nbytes + (0 if kv.kept is None else kv.kept.nbytes)
    return entries, nbytes


def full_cache_bytes(model: DiffusionGemma, prompt_len: int, batch: int = 1) -> int:
    """Bytes of the prompt cache kept whole: every position on full layers, the latest W - 1 on sliding ones."""
    element = torch.finfo(model.dtype).bits // 8
    total = 0
    for spec in model.gemma.layers:
        kept = spec.cached_prompt_entries
        entries = prompt_len if kept is None else min(prompt_len, kept)
        total += 2 * entries * spec.n_kv_heads * spec.head_dim * element
    return total * batch


# ----- the generation ------------------------------------------------------------------------------------------------

class GemmaRun:
    """One DiffusionGemma generation: its settings, forward, generator, response so far and run statistics."""

    def __init__(self, model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
                 on_event: Callable[[Event], None] | None, options: DiffusionGemmaOptions) -> None:
        if not isinstance(model, DiffusionGemma):
            raise TypeError(f"the DiffusionGemma sampler runs a DiffusionGemma model, not {type(model).__name__}")
        prompt = (prompt if prompt.dim() == 2 else prompt[None]).to(model.device)
        if prompt.shape[0] != 1:
            raise UsageError("DiffusionGemma generates one prompt at a time (a batch of prompts runs each alone)")
        if prompt.shape[1] != plan.prompt_len:
            raise ValueError(f"the cache plan is for a {plan.prompt_len}-token prompt, the prompt has "
                             f"{prompt.shape[1]}")
        if not plan.step_options.eager:
            raise UsageError("the compile and cuda-graph step modes are not available for DiffusionGemma")
        if plan.rope_factor != 1.0:
            raise UsageError("--long rope-scale is not available for DiffusionGemma (its two RoPE kinds are not "
                             "scaled); use --long parts or truncate")
        if plan.online:
            raise UsageError("--layer-budgets online is not available for DiffusionGemma; use auto or uniform")
        cfg = model.config
        self.model: DiffusionGemma = model
        self.prompt: Tensor = prompt
        self.plan: CachePlan = plan
        eos = cfg.stop_token_ids or (cfg.eos_token_id,)
        self.settings: DiffusionGemmaSampling = sampling_settings(gen, options, eos, cfg.pad_token_id)
        self.generator: torch.Generator = torch.Generator(device=model.device).manual_seed(gen.seed)
        c = model.gemma.canvas_length
        self.n_canvases: int = -(-self.settings.max_new_tokens // c)
        self.forward: GemmaForward = GemmaForward(model, plan, prompt, options.documents, self.n_canvases)
        self.emit: Callable[[Event], None] = on_event or (lambda e: None)
        self.mask_id: int = cfg.mask_token_id
        slots = (1, self.n_canvases * c)
        self.response: Tensor = torch.full(slots, self.mask_id, dtype=torch.long, device=model.device)
        self.token_probs: Tensor = torch.full(slots, float("nan"), dtype=torch.float64, device=model.device)
        self.canvas: int = 0
        self.steps: int = 0
        self.committed: int = 0
        self.last_raw: Tensor | None = None  # the latest decoder pass's logits (the committed canvas's argmax)
        self.stats: RunStats = RunStats(policy=plan.policy.name, prompt_len=prompt.shape[1], gen_length=0)
        self.output: LoopOutput | None = None
        reset_cuda_peaks(model_devices(model))
        self.start: float = now(model.device)
        self.last: float = self.start

    def decoded(self, raw: Tensor) -> None:
        """A decoder pass came back: time it and tell the display."""
        self.last_raw = raw
        t = now(self.model.device)
        if self.steps == 0:
            self.stats.prefill_s = t - self.start
        else:
            self.stats.step_s.append(t - self.last)
        self.last = t
        self.emit(Event("prefill" if self.steps == 0 else "step", self.canvas, self.n_canvases, self.steps, 0,
                        self.response.shape[1] - self.committed, t - self.start, self.response))
        self.steps += 1

    def commit(self, tokens: Tensor) -> None:
        """A canvas is final (``tokens`` (1, C), padded after an EOS): keep it and its tokens' probabilities, the
        model's (temperature 1) at the canvas's last decoder pass; none where the EOS rule padded."""
        c = tokens.shape[1]
        at = slice(self.canvas * c, (self.canvas + 1) * c)
        self.response[:, at] = tokens
        assert self.last_raw is not None
        raw = self.last_raw.float()
        probs = raw.softmax(-1).gather(-1, tokens[..., None]).squeeze(-1).double()
        self.token_probs[:, at] = torch.where(tokens == raw.argmax(-1), probs, float("nan"))
        self.canvas += 1
        self.committed += c

    def finish(self, output: LoopOutput) -> None:
        m, c = self.prompt.shape[1], self.model.gemma.canvas_length
        self.output = output
        if output.sequences.shape[1] - m > self.committed:  # the last canvas is never committed to the cache
            self.commit(output.sequences[:, m + self.committed : m + self.committed + c])

    def result(self) -> GenerationResult:
        stats, forward = self.stats, self.forward
        n = self.committed
        stats.total_s = now(self.model.device) - self.start
        stats.steps_run = self.steps
        stats.gen_length = n
        stats.peak_mem_bytes, stats.mem_kind = peak_memory(model_devices(self.model))
        stats.kv_entries, stats.kv_bytes = forward.kv_entries, forward.kv_bytes
        stats.kv_full_bytes = full_cache_bytes(self.model, self.prompt.shape[1])  # type: ignore[arg-type]
        stats.weights_bytes, stats.quantization = held_bytes(self.model), quantization_of(self.model)
        self.emit(Event("done", 0, 0, self.steps, 0, 0, stats.total_s))
        records, budgets = forward.layer_records()
        return GenerationResult(self.response[:, :n].clone(), stats, records, budgets, self.token_probs[:, :n].clone(),
                                self.plan)


def diffusion_gemma_loop(run: GemmaRun) -> Loop:
    """The sampler's requests (``denoising_loop``) as the driver runs them: each decoder pass is sent its logits
    back, each commit nothing."""
    model = run.model
    assert isinstance(model, DiffusionGemma)
    inner = denoising_loop(run.prompt, model.gemma.vocab_size, model.gemma.canvas_length, model.dtype, run.settings,
                           run.generator)
    try:
        request = next(inner)
        while True:
            logits = yield GemmaStep(run.prompt, NO_ROWS, request=request)
            if isinstance(request, CommitRequest):
                run.commit(request.tokens)
                request = inner.send(None)
            else:
                assert isinstance(logits, Tensor)  # a decoder pass: its logits (this family asks no picks)
                run.decoded(logits)
                request = inner.send(logits)
    except StopIteration as stop:
        run.finish(stop.value)


def diffusion_gemma_run(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
                        on_event: Callable[[Event], None] | None = None,
                        options: DiffusionGemmaOptions | None = None) -> GemmaRun:
    """The generation state DiffusionGemma's loop runs on."""
    return GemmaRun(model, prompt, gen, plan, on_event, options or DiffusionGemmaOptions())


__all__ = ["DETERMINISTIC_T_MAX", "DiffusionGemmaOptions", "DocumentCache", "GemmaForward", "GemmaRun", "GemmaStep",
           "cache_size", "diffusion_gemma_defaults", "diffusion_gemma_loop", "diffusion_gemma_run",
           "full_cache_bytes", "sampling_settings"]
