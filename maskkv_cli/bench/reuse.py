"""``maskkv bench reuse``: one document, many questions, against as many separate asks: on a block-causal model
(LLaDA2) its document blocks, on DiffusionGemma its encoder's cache of the document.

A random-weight model of a named shape (``llada2-small`` by default) answers ``questions`` questions about one
``doc_tokens``-token document (random token ids; the question ids differ per question) twice, in the same
process, one after the other:

- **separate**: every question's prompt runs whole (the prefill over the document and the question, then the
  blocks), as when each question is asked on its own without a stored prefix;
- **reused**: the document's whole blocks run once (``engine.prefix.compute_prefix``, timed with the rest) and
  each question's prefill runs only its own rows over them.

Both use the same policy and budget (MaskKV at 256 entries per head by default: each question still evicts from
the document with its own votes).

A DiffusionGemma shape (``diffusiongemma-small``, ``diffusiongemma-tiny``: ``models.diffusion_gemma_config``)
runs its own sampler (temperature 0, the deterministic limit; ``gen_length`` rounded up to whole canvases;
``block_length`` unused): **separate** encodes each prompt in the two chunks every DiffusionGemma prompt is encoded
in (the document, then the question), **reused** encodes the document's chunk once (``DocumentCache``) and each
question's chunk over it; the stored prefix is the document's cache on every layer.

Reported: total seconds of each (median of ``repeats`` runs, after a warm-up), the speed-up, the prefill seconds
of each (every answer's ``prefill_s``, plus, reused, the document's own computation: what reuse saves, without
the denoising steps, whose number per answer and time per pass vary much more than that between runs), the peak of
live tensor bytes above the weights (``live_bytes.LiveBytes``: exact, the allocator aside) of each, the stored
prefix's bytes, and how many answers are token for token the same in both.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from maskkv_cli.bench.cases import load_bench_model, random_prompt
from maskkv_cli.bench.live_bytes import LiveBytes
from maskkv_cli.errors import UsageError
from maskkv_cli.models.meta import meta_device
from maskkv_cli.models.rows import small_rows


@dataclass(frozen=True)
class ReuseCase:
    config: str = "llada2-small"
    doc_tokens: int = 4096
    questions: int = 8
    question_tokens: int = 24
    gen_length: int = 32
    block_length: int = 32
    policy: str = "maskkv"
    budget: int = 256
    repeats: int = 3
    threads: int = 1
    dtype: str = "auto"
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The case's fields; the budget None for a policy that keeps no budget (none, full)."""
        from maskkv_cli.policies import get_policy

        out = asdict(self)
        if not get_policy(self.policy).evicts:
            out["budget"] = None
        return out


def _run(model: Any, prompts: list[torch.Tensor], doc: list[int], case: ReuseCase,
         reuse: bool) -> tuple[float, int, list[torch.Tensor], int, float]:
    """(seconds, peak live bytes, each answer's tokens, stored prefix bytes, prefill seconds) of answering every
    prompt."""
    from maskkv_cli.engine.plan import CachePlan
    from maskkv_cli.engine.prefix import compute_prefix
    from maskkv_cli.policies import get_policy
    from maskkv_cli.sampling import GenerationConfig, sample

    gen = GenerationConfig(gen_length=case.gen_length, steps=case.gen_length, block_length=case.block_length)
    whole = len(doc) // case.block_length * case.block_length
    answers: list[torch.Tensor] = []
    stored = 0
    small_rows(str(model.device), model.dtype)  # the engine's once-per-process probe (models/rows.py), not a run's
    with LiveBytes() as live:
        started = time.perf_counter()
        prefix = compute_prefix(model, doc[:whole], case.block_length) if reuse and whole else None
        prefill = time.perf_counter() - started  # the document's blocks, once
        if prefix is not None:
            stored = prefix.nbytes()
        for prompt in prompts:
            plan = CachePlan.build(model, get_policy(case.policy), case.budget, prompt.shape[1],
                                   block_length=case.block_length, prefix=prefix)
            result = sample(model, prompt, gen, plan)
            answers.append(result.tokens)
            prefill += result.stats.prefill_s
        seconds = time.perf_counter() - started
        del prefix
    return seconds, live.peak, answers, stored, prefill


def _run_gemma(model: Any, prompts: list[torch.Tensor], doc: list[int], case: ReuseCase,
               reuse: bool) -> tuple[float, int, list[torch.Tensor], int, float]:
    """``_run`` of a DiffusionGemma model: each prompt's document chunk encoded for it, or once for all."""
    from maskkv_cli.engine.plan import CachePlan
    from maskkv_cli.policies import get_policy
    from maskkv_cli.sampling import GenerationConfig, sample
    from maskkv_cli.sampling.diffusion_gemma import DiffusionGemmaOptions, DocumentCache

    gen = GenerationConfig(gen_length=case.gen_length, steps=case.gen_length, block_length=case.gen_length,
                           seed=case.seed)
    documents = DocumentCache() if reuse else None
    options = DiffusionGemmaOptions(documents=documents)
    answers: list[torch.Tensor] = []
    prefill = 0.0
    small_rows(str(model.device), model.dtype)
    with LiveBytes() as live:
        started = time.perf_counter()
        for prompt in prompts:
            plan = CachePlan.build(model, get_policy(case.policy), case.budget, prompt.shape[1],
                                   document_len=len(doc))
            result = sample(model, prompt, gen, plan, diffusion_gemma=options)
            answers.append(result.tokens)
            prefill += result.stats.prefill_s
        seconds = time.perf_counter() - started
        stored = 0 if documents is None else documents.stored_bytes()
        del documents, options
    return seconds, live.peak, answers, stored, prefill


def _gemma_model(case: ReuseCase) -> Any:
    """A DiffusionGemma of a named shape with random weights (``DiffusionGemma.init_weights``)."""
    from maskkv_cli.models.diffusion_gemma import DiffusionGemma
    from maskkv_cli.models.diffusion_gemma_config import named_config as gemma_config
    from maskkv_cli.models.loading import parse_dtype

    with meta_device():
        model = DiffusionGemma(gemma_config(case.config))
    model = model.to(dtype=parse_dtype(case.dtype)).to_empty(device="cpu").init_weights(case.seed)
    return model.requires_grad_(False).eval()


@torch.no_grad()
def run_reuse(case: ReuseCase) -> dict[str, Any]:
    """Measure ``case`` in this process (see the module doc); the row of figures."""
    from maskkv_cli.models.diffusion_gemma_config import NAMED_CONFIGS as GEMMA_CONFIGS

    given = {"--doc-tokens": case.doc_tokens, "--questions-per-doc": case.questions,
             "question tokens": case.question_tokens, "--gen-length": case.gen_length, "--repeats": case.repeats,
             "--threads": case.threads}
    bad = [f"{name} {value}" for name, value in given.items() if value < 1]
    if bad:
        raise UsageError(f"these must be positive: {', '.join(bad)}")
    torch.set_num_threads(case.threads)
    gemma = case.config in GEMMA_CONFIGS
    model = _gemma_model(case) if gemma else load_bench_model(case.config, None, torch.device("cpu"), case.dtype,
                                                              case.seed)
    if not gemma and not model.config.block_causal:
        raise UsageError(f"--config {case.config} neither is block-causal nor a DiffusionGemma shape; reuse is for "
                         f"LLaDA2 shapes (llada2-small, llada2-mini) and {', '.join(GEMMA_CONFIGS)}")
    run = _run_gemma if gemma else _run
    doc = random_prompt(model.config, case.doc_tokens, case.seed, torch.device("cpu"))[0].tolist()
    prompts = [torch.tensor([doc + random_prompt(model.config, case.question_tokens, case.seed + 1 + i,
                                                 torch.device("cpu"))[0].tolist()])
               for i in range(case.questions)]
    warm = prompts[0][:, -min(prompts[0].shape[1], 2 * case.block_length):]
    run(model, [warm], warm[0].tolist()[: case.block_length], case, True)  # kernels and allocator warmed up
    separate, reused = [], []
    for _ in range(case.repeats):  # alternate, so that a slow phase of the machine hits both
        separate.append(run(model, prompts, doc, case, False))
        reused.append(run(model, prompts, doc, case, True))
    same = sum(torch.equal(a, b) for a, b in zip(separate[0][2], reused[0][2], strict=True))
    sep_s = statistics.median(r[0] for r in separate)
    reu_s = statistics.median(r[0] for r in reused)
    sep_prefill = statistics.median(r[4] for r in separate)
    reu_prefill = statistics.median(r[4] for r in reused)
    return {**case.as_dict(), "separate_s": round(sep_s, 4), "reused_s": round(reu_s, 4),
            "speedup": round(sep_s / reu_s, 3), "separate_prefill_s": round(sep_prefill, 4),
            "reused_prefill_s": round(reu_prefill, 4), "prefill_speedup": round(sep_prefill / reu_prefill, 3),
            "separate_peak_bytes": max(r[1] for r in separate),
            "reused_peak_bytes": max(r[1] for r in reused), "prefix_bytes": reused[0][3],
            "answers_equal": same, "runs": case.repeats}
