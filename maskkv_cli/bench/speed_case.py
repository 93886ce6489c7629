"""One case of ``maskkv bench speed`` measured in this process, and its fresh process.

Each case (policy, budget, prompt length) runs in a fresh process (``python -m maskkv_cli.bench.speed_case --case
JSON`` prints one JSON row), so that its peak memory is its own: the CUDA allocator's peak after a reset on a GPU,
the process's peak resident set on the CPU (reset after loading and warm-up where Linux allows, else since the
start). Inside the case: load the weights (random weights of a named shape, or a checkpoint), warm up with a
short run at a small length (and, on CUDA or up to 4k tokens, one prefill at the case's own length:
``warms_own_length``), run the generation on random prompt ids with device syncs before each clock read, read the
peak, then time the limit (``maskkv_cli.bench.limit``). A DiffusionGemma shape or checkpoint runs its own sampler,
steps and limit (``bench/speed_gemma.py``).

``none`` recomputes the whole sequence at each step, which is too slow to run to the end at long prompts: it
runs ``none_steps`` steps (step 0 included), and the end-to-end time is ``step 0 + (steps - 1) x median step``,
labelled ``extrapolated``.

A case of batch size B > 1 generates B sequences of the prompt length (distinct random prompts, row ``j`` of one
seeded draw, row 0 the batch-size-1 prompt) together with ``sampling.stream.sample_many`` (their prefill shared,
then their later steps share one forward). Its times are the batch's: ``prefill_s`` until the last sequence has
prefilled, ``step_s`` the median of the last sequence's steps (each one shared forward and every sequence's
commits), ``total_s`` all B sequences end to end; ``tokens_per_s = B x gen_length / total_s``. Its limit is
``limit.measure_batch_limit``. Batch size 1 is the single-sequence path above, unchanged.
"""


from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from maskkv_cli.bench.cases import (
    case_main,
    load_bench_model,
    random_prompt,
    run_in_fresh_process,
    run_to_prefill,
    weights_bytes,
)
from maskkv_cli.bench.ceiling import ceiling_fields
from maskkv_cli.bench.limit import measure_batch_limit, measure_limit, rows_schedule
from maskkv_cli.bench.speed_gemma import gemma_bench_model, run_gemma_case
from maskkv_cli.bench.speed_settings import SpeedCase, gen_config, is_gemma_shape, warms_own_length
from maskkv_cli.engine.batch_memory import Geometry, batch_memory, model_geometry
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.errors import UsageError
from maskkv_cli.models.base import kv_bytes_per_token
from maskkv_cli.models.diffusion_gemma import DiffusionGemma
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.runtime.stats import now, read_current, read_peak, reset_peak, rss_bytes, settle_memory
from maskkv_cli.sampling.llada2 import LLaDA2Options
from maskkv_cli.sampling.stream import BatchJob, sample_many

WARMUP_PROMPT = 256  # prompt tokens of the warm-up run (or the case's own length when shorter)


class _Stop(Exception):
    """Raised from the progress callback to end a ``none`` run after its timed steps."""


# LLaDA2 runs the same steps whatever random weights give: no token is ever above the threshold (each step
# commits its quota) and decoding goes on after an end-of-text token; the limit line counts those steps.
FIXED_STEPS = LLaDA2Options(threshold=1.0, stop_at_eos=False)


def _plan(model: DiffusionLM, policy: Any, budget: int | None, prompt: torch.Tensor, case: SpeedCase) -> CachePlan:
    return CachePlan.build(model, policy, budget, prompt.shape[1], step_options=StepOptions.from_label(case.step_mode),
                           block_length=min(case.block_length, case.gen_length))


def _jobs(model: DiffusionLM, policy: Any, budget: int | None, prompts: torch.Tensor, gen: Any,
          case: SpeedCase) -> list[BatchJob]:
    """One job per row of ``prompts`` (B, M), each with its own cache plan."""
    return [BatchJob(prompts[j : j + 1], gen, _plan(model, policy, budget, prompts[j : j + 1], case))
            for j in range(prompts.shape[0])]


def _warm_prefill(model: DiffusionLM, case: SpeedCase, policy: Any, budget: int | None) -> None:
    """Step 0 of the case's own generation (its prompt length, gen length, budget and batch size, on another
    random prompt), stopped right after it: the timed prefill then runs on a warmed allocator."""
    from maskkv_cli.sampling import sample

    dev = model.device
    gen = gen_config(case)
    prompt = random_prompt(model.config, case.prompt_len, case.seed + 1, dev, batch=case.batch_size)
    if case.batch_size > 1:
        _run_batch(model, prompt, gen, policy, budget, case, 1, timed=1)
        return
    plan = _plan(model, policy, budget, prompt, case)
    run_to_prefill(lambda on_event: sample(model, prompt, gen, plan, on_event, llada2=FIXED_STEPS))


def _warmup(model: DiffusionLM, case: SpeedCase, policy: Any, budget: int | None) -> float:
    """A short generation (and limit) at a small length, with the case's batch size: kernels, allocator and
    caches warmed up; then, where ``warms_own_length`` says, one prefill at the case's own length."""
    from maskkv_cli.sampling import SamplerOptions, sample

    dev = model.device
    t0 = now(dev)
    m = min(case.prompt_len, WARMUP_PROMPT)
    g = gen_config(case, gen_length=case.block_length, steps=min(4, case.steps))  # one block, a few steps
    prompt = random_prompt(model.config, m, case.seed + 1, dev, batch=case.batch_size)
    b = None if budget is None else max(1, min(budget, m // 2))
    keys = None if not policy.uses_cache else (b if b is not None else m)
    if case.batch_size == 1:
        sample(model, prompt, g, _plan(model, policy, b, prompt, case), llada2=FIXED_STEPS)
        if case.limit:
            measure_limit(model, prompt, g, keys, case.seed)
    else:
        sample_many(model, _jobs(model, policy, b, prompt, g, case), case.batch_size,
                    SamplerOptions(llada2=FIXED_STEPS))
        if case.limit:
            measure_batch_limit(model, prompt, g, keys, case.seed)
    if warms_own_length(dev, case.prompt_len):
        _warm_prefill(model, case, policy, budget)
    return now(dev) - t0


def _run_none(model: DiffusionLM, prompt: torch.Tensor, gen: Any, policy: Any, timed: int) -> tuple[float, list[float]]:
    """Step 0 and up to ``timed - 1`` more steps of the no-cache sampler; (step 0 seconds, later step seconds)."""
    from maskkv_cli.sampling import sample

    marks: list[float] = []

    def on_event(event: Any) -> None:
        if event.kind in ("prefill", "step"):
            marks.append(event.elapsed_s)
            if len(marks) >= timed:
                raise _Stop

    try:
        sample(model, prompt, gen, CachePlan.build(model, policy, None, prompt.shape[1], block_length=gen.block_length),
               on_event, llada2=FIXED_STEPS)
    except _Stop:
        pass
    diffs = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return marks[0], diffs


@dataclass
class BatchRun:
    """The times and caches of one batch (see the module doc)."""

    prefill_s: float
    step_s: float
    total_s: float
    steps_run: int
    steps_timed: int
    extrapolated: bool
    kv_bytes: int = 0
    kv_entries: int = 0
    kv_full_bytes: int = 0


def _run_batch(model: DiffusionLM, prompts: torch.Tensor, gen: Any, policy: Any, budget: int | None,
               case: SpeedCase, steps: int, timed: int | None) -> BatchRun:
    """The B sequences ``prompts`` (B, M) through ``sample_many``, all at once; ``steps``: the steps each runs.

    Clocks read at each step of the last sequence to join (synchronised): the first mark is when every sequence
    has prefilled, the later marks one shared step apart. ``timed``: stop after that many marks and extrapolate
    the rest (``none``); None runs to the end."""
    from maskkv_cli.sampling import SamplerOptions

    dev = model.device
    marks: list[float] = []

    def on_last(event: Any) -> None:
        if event.kind in ("prefill", "step"):
            marks.append(now(dev))
            if timed is not None and len(marks) >= timed:
                raise _Stop

    jobs = _jobs(model, policy, budget, prompts, gen, case)
    last = jobs[-1]
    jobs[-1] = BatchJob(last.prompt, last.gen, last.plan, on_last)
    results: list[Any] = []
    t0 = now(dev)
    try:
        results = sample_many(model, jobs, len(jobs), SamplerOptions(llada2=FIXED_STEPS))
    except _Stop:
        pass
    end = now(dev)
    prefill_s = marks[0] - t0
    later = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    step_s = statistics.median(later) if later else prefill_s
    if not results:
        return BatchRun(prefill_s, step_s, prefill_s + (steps - 1) * step_s, steps, len(marks), True)
    return BatchRun(prefill_s, step_s, end - t0, len(marks), len(marks), False,
                    sum(r.stats.kv_bytes for r in results), sum(r.stats.kv_entries for r in results),
                    sum(r.stats.kv_full_bytes for r in results))


def memory_model_fields(shapes: Geometry, prompt_len: int, gen_length: int, kept: int | None,
                        element_bytes: int, batch: int) -> dict[str, int | None]:
    """The memory model's figures (``engine/batch_memory.py``) for a row: per sequence, once, and the whole
    batch; None without a cache (``kept`` None)."""
    if kept is None:
        return dict.fromkeys(("model_cache_per_sequence_bytes", "model_step_per_sequence_bytes",
                              "model_prefill_peak_bytes", "model_batch_bytes"))
    memory = batch_memory(shapes, prompt_len, gen_length, kept, element_bytes)
    return {"model_cache_per_sequence_bytes": memory.cache_per_sequence,
            "model_step_per_sequence_bytes": memory.step_per_sequence,
            "model_prefill_peak_bytes": memory.prefill_peak, "model_batch_bytes": memory.total(batch)}


def run_case(case: SpeedCase) -> dict[str, Any]:
    """Measure one case in this process and return its row (see the module docstring)."""
    from maskkv_cli.policies import get_policy
    from maskkv_cli.sampling import sample

    torch.set_num_threads(case.threads)
    dev = torch.device(case.device)
    if case.prompt_len <= 0:
        raise UsageError("prompt lengths must be positive")
    if case.none_steps < 1:
        raise UsageError("--none-steps must be at least 1")
    if case.batch_size < 1:
        raise UsageError("--batch-sizes must be positive whole numbers")
    started = time.time()
    rss_start = rss_bytes()
    if not case.model and is_gemma_shape(case.config):
        model: DiffusionLM = gemma_bench_model(case.config or "", dev, case.dtype, case.seed, case.quantize)
    else:
        model = load_bench_model(case.config, case.model, dev, case.dtype, case.seed, case.quantize)
    cfg = model.config
    now(dev)
    settle_memory(dev)
    loaded_mem = read_current(dev)
    if isinstance(model, DiffusionGemma):  # its own sampler, steps and limit (bench/speed_gemma.py)
        return run_gemma_case(case, model, loaded_mem, rss_start, started)
    policy = get_policy(case.policy)
    budget = case.budget if policy.evicts else None
    if policy.evicts and budget is None:
        raise UsageError(f"policy {case.policy} needs a budget")
    gen = gen_config(case)
    sched = rows_schedule(gen, case.prompt_len if model.config.block_causal else None)
    warm_s = _warmup(model, case, policy, budget) if case.warmup else 0.0
    batch = case.batch_size
    prompt = random_prompt(cfg, case.prompt_len, case.seed, dev, batch=batch)
    settle_memory(dev)
    peak_reset = reset_peak(dev)
    base_mem = read_current(dev)
    kv_bytes = kv_entries = 0
    elt = torch.finfo(model.dtype).bits // 8
    kv_full = batch * kv_bytes_per_token(model) * case.prompt_len
    extrapolated = False
    setup_s = 0.0
    if batch > 1:
        timed = case.none_steps if not policy.uses_cache and case.none_steps < len(sched) else None
        run = _run_batch(model, prompt, gen, policy, budget, case, len(sched), timed)
        prefill_s, step_s, total_s = run.prefill_s, run.step_s, run.total_s
        steps_run, steps_timed, extrapolated = run.steps_run, run.steps_timed, run.extrapolated
        if policy.uses_cache:
            kv_bytes, kv_entries, kv_full = run.kv_bytes, run.kv_entries, run.kv_full_bytes
    elif not policy.uses_cache and case.none_steps < len(sched):
        prefill_s, later = _run_none(model, prompt, gen, policy, case.none_steps)
        step_s = statistics.median(later) if later else prefill_s
        total_s = prefill_s + (len(sched) - 1) * step_s
        steps_run, steps_timed, extrapolated = len(sched), 1 + len(later), True
    else:
        result = sample(model, prompt, gen, _plan(model, policy, budget, prompt, case), llada2=FIXED_STEPS)
        st = result.stats
        setup_s = st.setup_s
        prefill_s, step_s, total_s = st.prefill_s, st.median_step_s, st.total_s
        steps_run = steps_timed = st.steps_run
        kv_bytes, kv_entries, kv_full = st.kv_bytes, st.kv_entries, st.kv_full_bytes
        del result
    peak = read_peak(dev)
    keys = None if not policy.uses_cache else (budget if budget is not None else case.prompt_len)
    row: dict[str, Any] = {
        "key": case.key(),
        "method": case.method,
        **asdict(case),
        "weights_bytes": weights_bytes(model),
        "n_params": sum(p.numel() for p in model.parameters()),
        "loaded_mem_bytes": loaded_mem,
        "start_rss_bytes": rss_start,
        "base_mem_bytes": base_mem,
        "mem_kind": "cuda" if dev.type == "cuda" else "rss",
        "peak_reset": peak_reset,
        "peak_mem_bytes": peak,
        "peak_above_weights_bytes": max(0, peak - loaded_mem),
        "prefill_s": prefill_s,
        "step_s": step_s,
        "total_s": total_s,
        "tokens_per_s": batch * case.gen_length / total_s if total_s > 0 else 0.0,
        "seconds_per_sequence": total_s / batch,
        "steps_run": steps_run,
        "steps_timed": steps_timed,
        "extrapolated": extrapolated,
        "kv_bytes": kv_bytes,
        "kv_entries": kv_entries,
        "kv_full_bytes": kv_full,
        "kv_bytes_per_sequence": kv_bytes // batch,
        **memory_model_fields(model_geometry(model), case.prompt_len, case.gen_length, keys, elt, batch),
        "activation_bytes": max(0, peak - loaded_mem - kv_bytes),  # peak above weights, less the kept cache
        "warmup_s": warm_s,
        # whether a prefill at the case's own length warmed up too
        "warmup_own_length": case.warmup and warms_own_length(dev, case.prompt_len),
        "setup_s": setup_s,  # compilation / graph capture of the step, kept out of total_s
        "evicted": bool(policy.evicts and budget is not None and budget < case.prompt_len),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }
    if case.limit:
        lim = (measure_limit(model, prompt, gen, keys, case.seed) if batch == 1
               else measure_batch_limit(model, prompt, gen, keys, case.seed))
        row.update(limit_s=lim.total_s, limit_prefill_s=lim.prefill_s, limit_step_s=lim.median_step_s,
                   limit_keys=lim.attention_keys, limit_extrapolated=lim.extrapolated,
                   measured_over_limit=total_s / lim.total_s if lim.total_s > 0 else None)
        # one sequence's prefill FLOPs over its share of the batch's prefill time
        row.update(ceiling_fields(model, dev, case.prompt_len, case.gen_length, prefill_s / batch))
    else:
        row.update(limit_s=None, limit_prefill_s=None, limit_step_s=None, limit_keys=None, limit_extrapolated=None,
                   measured_over_limit=None)
    row["wall_s"] = time.time() - started
    return row


def run_case_subprocess(case: SpeedCase, timeout: float | None = None,
                        module: str = "maskkv_cli.bench.speed_case", log_dir: Path | None = None) -> dict[str, Any]:
    """Run ``case`` in a fresh Python process and return the JSON row it prints; its stderr is kept in
    ``log_dir/<key>.txt`` when ``log_dir`` is given; past ``timeout`` seconds it is killed (``BenchError``)."""
    batch = f" batch {case.batch_size}" if case.batch_size > 1 else ""
    log = None if log_dir is None else log_dir / f"{case.key()}.txt"
    return run_in_fresh_process(module, case.to_json(), case.threads,
                                f"case {case.method} at prompt {case.prompt_len}{batch}", timeout, log)


def main(argv: Sequence[str] | None = None) -> int:
    return case_main(argv, "maskkv_cli.bench.speed_case", lambda text: run_case(SpeedCase.from_json(text)))


if __name__ == "__main__":
    raise SystemExit(main())
