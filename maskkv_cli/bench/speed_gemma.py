"""One ``maskkv bench speed`` case on DiffusionGemma, in the case's fresh process (``bench/speed_case.py`` hands it
over once the model is loaded).

The model: random weights of a DiffusionGemma shape (``models/diffusion_gemma_config``'s named shapes:
``diffusiongemma-tiny`` and ``-small`` run on a CPU, ``diffusiongemma-26b-a4b`` is the released text model, 47 GiB
in bf16), built on the meta device and filled in place on the case's device in its dtype, so that nothing holds a
second copy; refused in one line, before anything is allocated, where the weights do not fit the device's free
memory. Or a DiffusionGemma checkpoint (``--model``).

What runs: the family's own sampler (``sampling/diffusion_gemma.py``, through ``sampling.sample`` as ``ask`` runs
it) on a random prompt, the prompt cache as the policy says: ``full``, MaskKV and the baselines at each budget (the
first decoder pass's votes cut the full layers, layer by layer with the encoder where the shape chooses it), or
``none`` (the prompt and the committed canvases encoded again before every decoder pass). ``gen_length`` rounds up
to whole canvases; every canvas runs ``steps`` decoder passes (its ``max_denoising_steps``; 48 released), with the
adaptive stopping rule and the EOS rule off (random weights would stop after a pass or two; a benchmark times the
passes an answer runs) and temperature 0. The warm-up before it: a short prompt's canvas of two passes and, on CUDA
or for prompts up to 4k tokens, the case's own prefill (``speed_settings.warms_own_length``).

Reported as the other families' rows: ``prefill_s`` the prompt's encoding and the first decoder pass, ``step_s``
the median later pass (a commit's encoding falls into the pass after it), ``total_s``, ``tokens_per_s`` = the
generated tokens (whole canvases) / total, the kept cache's bytes, the peak memory and the memory model's figures.
``none`` runs ``none_steps`` passes and is extrapolated to all of them (its later canvases re-encode more: the
extrapolation is low by the committed canvases' encoding).

The limit: the bare work a cached run cannot avoid, timed on the same model: one encode of the prompt, one decoder
pass over the whole cache (the votes' pass), then ``passes - 1`` decoder passes over the kept entries (``budget``
per KV head on every full layer, no padding; the sliding layers' W - 1) with a self-conditioning signal, and one
encode of each committed canvas. Three later passes are timed and their median extrapolated. ``none``: every pass an
encode of the prompt and a pass over its whole cache. No sampler bookkeeping (the temperature, the draws, the
entropy bound), no scoring, no selection.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from maskkv_cli.bench.cases import random_prompt, run_to_prefill, weights_bytes
from maskkv_cli.bench.limit import LimitTiming
from maskkv_cli.bench.speed_settings import SpeedCase, check_gemma_fits, warms_own_length
from maskkv_cli.engine.batch_memory import batch_memory, model_geometry
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.errors import UsageError
from maskkv_cli.models.diffusion_gemma import DiffusionGemma, LayerKV, PromptCache
from maskkv_cli.models.diffusion_gemma_config import named_config
from maskkv_cli.models.meta import meta_device
from maskkv_cli.runtime.stats import now, read_current, read_peak, reset_peak, settle_memory
from maskkv_cli.sampling.diffusion_gemma import DiffusionGemmaOptions, full_cache_bytes

WARMUP_PROMPT = 256  # prompt tokens of the warm-up run (or the case's own length when shorter)
TIMED_PASSES = 3  # later decoder passes the limit times (their median is extrapolated)


class _Stop(Exception):
    """Raised from the progress callback to end a ``none`` run after its timed passes."""


def gemma_bench_model(name: str, device: torch.device, dtype: str, seed: int, quantize: str = "none"
                      ) -> DiffusionGemma:
    """Random weights of the named DiffusionGemma shape on ``device`` (see the module doc): normal(0, 0.02) for the
    matrices and the embedding, ones for norm weights, router scales and layer scalars, as ``init_weights``;
    ``quantize``: its projections and experts then quantized (``models/quantize.py``; int4 runs bf16 on the CPU)."""
    from maskkv_cli.models.loading import parse_dtype
    from maskkv_cli.models.quantize import quantize_model

    check_gemma_fits(name, str(device), dtype)
    cfg = named_config(name)
    dt = parse_dtype(dtype, device, quantize)
    with meta_device():
        model = DiffusionGemma(cfg)
    model = model.to(dtype=dt).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", ".scale", "per_expert_scale")):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for buf in model.buffers():
            buf.fill_(1.0)
    return quantize_model(model.requires_grad_(False).eval(), quantize)  # type: ignore[return-value]


def fixed_passes(steps: int) -> DiffusionGemmaOptions:
    """The sampler's settings for a benchmark: ``steps`` decoder passes per canvas, no early stop, no EOS rule, no
    document cache."""
    return DiffusionGemmaOptions(max_denoising_steps=steps, stability_threshold=None, confidence_threshold=None,
                                 eos_token_ids=())


def _gen(case: SpeedCase, gen_length: int | None = None) -> Any:
    from maskkv_cli.sampling import GenerationConfig

    n = gen_length or case.gen_length
    return GenerationConfig(gen_length=n, steps=n, block_length=n, seed=case.seed)  # temperature 0


def _plan(model: DiffusionGemma, policy: Any, budget: int | None, prompt: Tensor) -> CachePlan:
    return CachePlan.build(model, policy, budget, prompt.shape[1])


@torch.no_grad()
def measure_gemma_limit(model: DiffusionGemma, prompt: Tensor, keys: int | None, canvases: int, steps: int,
                        seed: int) -> LimitTiming:
    """The limit line of a DiffusionGemma case (see the module doc); ``keys``: the kept prompt entries per KV head
    on the full layers (None: no cache)."""
    dev, c, m = model.device, model.gemma.canvas_length, prompt.shape[1]
    canvas = torch.randint(0, model.gemma.vocab_size, (prompt.shape[0], c),
                           generator=torch.Generator().manual_seed(seed)).to(dev)
    passes = canvases * steps
    t0 = now(dev)
    cache = model.encode(prompt, spare=canvases * c).cache
    t1 = now(dev)
    logits = model.decode(canvas, cache)
    t2 = now(dev)
    encode_s, first_s = t1 - t0, t2 - t1
    if keys is None:
        return LimitTiming(encode_s + first_s, [], passes * (encode_s + first_s), None, None, passes > 1)
    if keys < m:  # the kept entries: the first ``keys`` of every full layer (equal heads: no padding)
        cache = PromptCache(tuple(kv if spec.sliding else LayerKV(kv.keys[:, :, :keys], kv.values[:, :, :keys])
                                  for kv, spec in zip(cache, model.gemma.layers, strict=True)), m)
    steps_s = []
    for _ in range(min(TIMED_PASSES, passes - 1)):
        t = now(dev)
        model.decode(canvas, cache, logits)
        steps_s.append(now(dev) - t)
    commit_s = 0.0
    if canvases > 1:
        t = now(dev)
        model.commit(cache, canvas)
        commit_s = now(dev) - t
    timing = LimitTiming(encode_s + first_s, steps_s, keys=min(keys, m), attention_keys=min(keys, m) + c,
                         extrapolated=passes - 1 > len(steps_s))
    timing.total_s = timing.prefill_s + (passes - 1) * timing.median_step_s + (canvases - 1) * commit_s
    return timing


def _run_none(model: DiffusionGemma, prompt: Tensor, case: SpeedCase, policy: Any,
              options: DiffusionGemmaOptions) -> tuple[float, list[float]]:
    """The first ``none_steps`` decoder passes of ``none``: (the first's seconds, the later ones')."""
    from maskkv_cli.sampling import sample

    marks: list[float] = []

    def on_event(event: Any) -> None:
        if event.kind in ("prefill", "step"):
            marks.append(event.elapsed_s)
            if len(marks) >= case.none_steps:
                raise _Stop

    try:
        sample(model, prompt, _gen(case), _plan(model, policy, None, prompt), on_event, diffusion_gemma=options)
    except _Stop:
        pass
    return marks[0], [b - a for a, b in zip(marks, marks[1:], strict=False)]


def _warm_own_prefill(model: DiffusionGemma, case: SpeedCase, policy: Any, budget: int | None,
                      options: DiffusionGemmaOptions) -> None:
    """The case's own prefill (its prompt length, budget and passes, on another random prompt: the encoder and the
    first decoder pass), stopped there, so that the timed one is not the process's first at its size."""
    from maskkv_cli.sampling import sample
    prompt = random_prompt(model.config, case.prompt_len, case.seed + 1, model.device)
    plan = _plan(model, policy, budget, prompt)
    run_to_prefill(lambda on_event: sample(model, prompt, _gen(case), plan, on_event, diffusion_gemma=options))


def run_gemma_case(case: SpeedCase, model: DiffusionGemma, loaded_mem: int, rss_start: int,
                   started: float) -> dict[str, Any]:
    """Measure one case on a loaded DiffusionGemma (see the module doc); the row."""
    from maskkv_cli.policies import get_policy
    from maskkv_cli.sampling import sample

    if case.batch_size != 1:
        raise UsageError("DiffusionGemma runs one generation at a time (each alone in the driver); use "
                         "--batch-sizes 1")
    if case.step_mode != "eager":
        raise UsageError("--step-modes other than eager are not available for DiffusionGemma")
    dev = model.device
    policy = get_policy(case.policy)
    budget = case.budget if policy.evicts else None
    if policy.evicts and budget is None:
        raise UsageError(f"policy {case.policy} needs a budget")
    c = model.gemma.canvas_length
    canvases = -(-case.gen_length // c)
    generated = canvases * c
    options = fixed_passes(case.steps)
    warm_s = 0.0
    if case.warmup:  # kernels, allocator and caches warmed up: a short prompt, one canvas of two passes
        t0 = now(dev)
        w = min(case.prompt_len, WARMUP_PROMPT)
        small = random_prompt(model.config, w, case.seed + 1, dev)
        sample(model, small, _gen(case, c), _plan(model, policy, None if budget is None else max(1, w // 2), small),
               diffusion_gemma=fixed_passes(2))
        if warms_own_length(dev, case.prompt_len):
            _warm_own_prefill(model, case, policy, budget, options)
        warm_s = now(dev) - t0
    prompt = random_prompt(model.config, case.prompt_len, case.seed, dev)
    settle_memory(dev)
    peak_reset = reset_peak(dev)
    base_mem = read_current(dev)
    passes = canvases * case.steps
    kv_bytes = kv_entries = 0
    extrapolated = False
    if not policy.uses_cache and case.none_steps < passes:
        prefill_s, later = _run_none(model, prompt, case, policy, options)
        step_s = statistics.median(later) if later else prefill_s
        total_s = prefill_s + (passes - 1) * step_s
        steps_run, steps_timed, extrapolated = passes, 1 + len(later), True
    else:
        result = sample(model, prompt, _gen(case), _plan(model, policy, budget, prompt), diffusion_gemma=options)
        st = result.stats
        prefill_s, step_s, total_s = st.prefill_s, st.median_step_s, st.total_s
        steps_run = steps_timed = st.steps_run
        kv_bytes, kv_entries = st.kv_bytes, st.kv_entries
        del result
    peak = read_peak(dev)
    keys = None if not policy.uses_cache else (budget if budget is not None else case.prompt_len)
    element = torch.finfo(model.dtype).bits // 8
    memory = None if keys is None else batch_memory(model_geometry(model), case.prompt_len, case.gen_length, keys,
                                                    element)
    row: dict[str, Any] = {
        "key": case.key(), "method": case.method, **asdict(case), "family": "diffusion_gemma",
        "canvas_length": c, "generated_tokens": generated,
        "weights_bytes": weights_bytes(model), "n_params": sum(p.numel() for p in model.parameters()),
        "loaded_mem_bytes": loaded_mem, "start_rss_bytes": rss_start, "base_mem_bytes": base_mem,
        "mem_kind": "cuda" if dev.type == "cuda" else "rss", "peak_reset": peak_reset, "peak_mem_bytes": peak,
        "peak_above_weights_bytes": max(0, peak - loaded_mem),
        "prefill_s": prefill_s, "step_s": step_s, "total_s": total_s,
        "tokens_per_s": generated / total_s if total_s > 0 else 0.0, "seconds_per_sequence": total_s,
        "steps_run": steps_run, "steps_timed": steps_timed, "extrapolated": extrapolated,
        "kv_bytes": kv_bytes, "kv_entries": kv_entries, "kv_full_bytes": full_cache_bytes(model, case.prompt_len),
        "kv_bytes_per_sequence": kv_bytes,
        "model_cache_per_sequence_bytes": None if memory is None else memory.cache_per_sequence,
        "model_step_per_sequence_bytes": None if memory is None else memory.step_per_sequence,
        "model_prefill_peak_bytes": None if memory is None else memory.prefill_peak,
        "model_batch_bytes": None if memory is None else memory.total(1),
        "activation_bytes": max(0, peak - loaded_mem - kv_bytes),
        "warmup_s": warm_s, "warmup_own_length": case.warmup and warms_own_length(dev, case.prompt_len),
        "setup_s": 0.0,
        "evicted": bool(policy.evicts and budget is not None and budget < case.prompt_len),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }
    if case.limit:
        lim = measure_gemma_limit(model, prompt, keys, canvases, case.steps, case.seed)
        row.update(limit_s=lim.total_s, limit_prefill_s=lim.prefill_s, limit_step_s=lim.median_step_s,
                   limit_keys=lim.attention_keys, limit_extrapolated=lim.extrapolated,
                   measured_over_limit=total_s / lim.total_s if lim.total_s > 0 else None)
    else:
        row.update(limit_s=None, limit_prefill_s=None, limit_step_s=None, limit_keys=None, limit_extrapolated=None,
                   measured_over_limit=None)
    row["wall_s"] = time.time() - started
    return row


__all__ = ["fixed_passes", "gemma_bench_model", "measure_gemma_limit", "run_gemma_case"]
