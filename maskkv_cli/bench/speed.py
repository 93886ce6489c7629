"""``maskkv bench speed``: no cache vs full cache vs MaskKV budgets over prompt lengths, in one run.

Each case (policy, budget, prompt length) runs in a fresh process (``python -m maskkv_cli.bench.speed --case
JSON`` prints one JSON row), so that its peak memory is its own: the CUDA allocator's peak after a reset on a GPU,
the process's peak resident set on the CPU (reset after loading and warm-up where Linux allows, else since the
start). Inside the case: load the weights (random weights of a named shape, or a checkpoint), warm up with a
short run at a small length, run the generation on random prompt ids with device syncs before each clock read,
read the peak, then time the limit (``maskkv_cli.bench.limit``).

``none`` recomputes the whole sequence at each step, which is too slow to run to the end at long prompts: it
runs ``none_steps`` steps (step 0 included), and the end-to-end time is ``step 0 + (steps - 1) x median step``,
labelled ``extrapolated``.

A case of batch size B > 1 generates B sequences of the prompt length (distinct random prompts, row ``j`` of one
seeded draw, row 0 the batch-size-1 prompt) together with ``sampling.batched.sample_many`` (their prefill shared,
then their later steps share one forward). Its times are the batch's: ``prefill_s`` until the last sequence has
prefilled, ``step_s`` the median of the last sequence's steps (each one shared forward and every sequence's
commits), ``total_s`` all B sequences end to end; ``tokens_per_s = B x gen_length / total_s``. Its limit is
``limit.measure_batch_limit``. Batch size 1 is the single-sequence path above, unchanged.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from maskkv_cli.bench.cases import (
    case_main,
    load_bench_model,
    random_prompt,
    run_in_fresh_process,
    weights_bytes,
)
from maskkv_cli.bench.ceiling import ceiling_fields
from maskkv_cli.bench.limit import measure_batch_limit, measure_limit, rows_schedule
from maskkv_cli.bench.results import ResultsFolder, settings_key
from maskkv_cli.bench.speed_report import summary_markdown, write_plot
from maskkv_cli.engine.batch_memory import batch_memory
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.errors import UsageError
from maskkv_cli.models.base import kv_bytes_per_token
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.sampling.llada2 import LLaDA2Options
from maskkv_cli.sampling.stream import BatchJob, sample_many
from maskkv_cli.stats import now, read_current, read_peak, reset_peak, rss_bytes

WARMUP_PROMPT = 256  # prompt tokens of the warm-up run (or the case's own length when shorter)


# ----- one case -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeedCase:
    """Everything that decides one row of the sweep."""

    policy: str
    budget: int | None
    prompt_len: int
    gen_length: int = 128
    steps: int = 128
    block_length: int = 32
    config: str | None = "llada-small"
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    none_steps: int = 3
    seed: int = 0
    threads: int = 1
    limit: bool = True
    warmup: bool = True
    step_mode: str = "eager"  # later steps: eager, compile, cuda-graph or compile+cuda-graph (step_runner.py)
    batch_size: int = 1  # sequences generated together (sample_many); 1: the single-sequence path

    def key(self) -> str:
        """The hash of the settings; batch size 1 is left out, so that a case keeps the key it had before batches."""
        settings = asdict(self)
        if self.batch_size == 1:
            del settings["batch_size"]
        return settings_key(settings)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SpeedCase:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UsageError(f"unknown case fields: {', '.join(sorted(unknown))}")
        return cls(**data)

    @property
    def method(self) -> str:
        name = self.policy if self.budget is None else f"{self.policy}@{self.budget}"
        return name if self.step_mode == "eager" else f"{name} {self.step_mode}"


class _Stop(Exception):
    """Raised from the progress callback to end a ``none`` run after its timed steps."""


def _gen_config(case: SpeedCase, gen_length: int | None = None, steps: int | None = None) -> Any:
    from maskkv_cli.sampling import GenerationConfig

    return GenerationConfig(gen_length=gen_length or case.gen_length, steps=steps or case.steps,
                            block_length=min(case.block_length, gen_length or case.gen_length), seed=case.seed)



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


def _warmup(model: DiffusionLM, case: SpeedCase, policy: Any, budget: int | None) -> float:
    """A short generation (and limit) at a small length, with the case's batch size: kernels, allocator and
    caches warmed up."""
    from maskkv_cli.sampling import SamplerOptions, sample

    dev = model.device
    t0 = now(dev)
    m = min(case.prompt_len, WARMUP_PROMPT)
    g = _gen_config(case, gen_length=case.block_length, steps=min(4, case.steps))  # one block, a few steps
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


def memory_model_fields(cfg: Any, prompt_len: int, gen_length: int, kept: int | None,
                        element_bytes: int, batch: int) -> dict[str, int | None]:
    """The memory model's figures (``engine/batch_memory.py``) for a row: per sequence, once, and the whole
    batch; None without a cache (``kept`` None)."""
    if kept is None:
        return dict.fromkeys(("model_cache_per_sequence_bytes", "model_step_per_sequence_bytes",
                              "model_prefill_peak_bytes", "model_batch_bytes"))
    memory = batch_memory(cfg, prompt_len, gen_length, kept, element_bytes)
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
    model = load_bench_model(case.config, case.model, dev, case.dtype, case.seed)
    cfg = model.config
    now(dev)
    loaded_mem = read_current(dev)
    policy = get_policy(case.policy)
    budget = case.budget if policy.evicts else None
    if policy.evicts and budget is None:
        raise UsageError(f"policy {case.policy} needs a budget")
    gen = _gen_config(case)
    sched = rows_schedule(gen, case.prompt_len if model.config.block_causal else None)
    warm_s = _warmup(model, case, policy, budget) if case.warmup else 0.0
    batch = case.batch_size
    prompt = random_prompt(cfg, case.prompt_len, case.seed, dev, batch=batch)
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
        **memory_model_fields(cfg, case.prompt_len, case.gen_length, keys, elt, batch),
        "activation_bytes": max(0, peak - loaded_mem - kv_bytes),  # peak above weights, less the kept cache
        "warmup_s": warm_s,
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
                        module: str = "maskkv_cli.bench.speed") -> dict[str, Any]:
    """Run ``case`` in a fresh Python process and return the JSON row it prints."""
    batch = f" batch {case.batch_size}" if case.batch_size > 1 else ""
    return run_in_fresh_process(module, case.to_json(), case.threads,
                                f"case {case.method} at prompt {case.prompt_len}{batch}", timeout)


# ----- the sweep ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeedSettings:
    prompt_lengths: tuple[int, ...] = (1024, 2048, 4096)
    policies: tuple[str, ...] = ("none", "full", "maskkv")
    budgets: tuple[int, ...] = (64, 256, 1024)
    gen_length: int = 128
    steps: int = 128
    block_length: int = 32
    config: str | None = "llada-small"
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    none_steps: int = 3
    seed: int = 0
    threads: int = 1
    limit: bool = True
    warmup: bool = True
    step_modes: tuple[str, ...] = ("eager",)  # each cache policy runs once per mode; ``none`` always eager
    batch_sizes: tuple[int, ...] = (1,)  # each method runs once per batch size
    repeats: int = 1  # runs of every case, round by round; a row is its case's median run

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON; batch sizes (1,) and one repeat are left out, so a run finds its folder from
        before those settings."""
        d = asdict(self)
        for k in ("prompt_lengths", "policies", "budgets", "step_modes", "batch_sizes"):
            d[k] = list(d[k])
        if self.batch_sizes == (1,):
            del d["batch_sizes"]
        if self.repeats == 1:
            del d["repeats"]
        return d

    def cases(self) -> list[SpeedCase]:
        """For each prompt length (ascending): none, full, then each evicting policy at each budget, each at every
        batch size (ascending)."""
        from maskkv_cli.policies.base import get_policy

        common = dict(gen_length=self.gen_length, steps=self.steps, block_length=self.block_length,
                      config=None if self.model else self.config, model=self.model, device=self.device,
                      dtype=self.dtype, none_steps=self.none_steps, seed=self.seed, threads=self.threads,
                      limit=self.limit, warmup=self.warmup)
        out: list[SpeedCase] = []
        for m in sorted(set(self.prompt_lengths)):
            for name in self.policies:
                policy = get_policy(name)
                modes = self.step_modes if policy.uses_cache else ("eager",)
                budgets: Sequence[int | None] = self.budgets if policy.evicts else (None,)
                out.extend(SpeedCase(name, b, m, step_mode=mode, batch_size=n, **common)  # type: ignore[arg-type]
                           for mode in modes for b in budgets for n in sorted(set(self.batch_sizes)))
        return out

    def check(self) -> None:
        from maskkv_cli.policies.base import get_policy

        if not self.prompt_lengths or min(self.prompt_lengths) <= 0:
            raise UsageError("--prompt-lengths must be positive numbers (e.g. 1k,2k,4k)")
        if not self.policies:
            raise UsageError("--policies is empty")
        for name in self.policies:
            if get_policy(name).evicts and (not self.budgets or min(self.budgets) <= 0):
                raise UsageError(f"policy {name} needs positive --budgets")
        if self.none_steps < 1:
            raise UsageError("--none-steps must be at least 1")
        if self.threads < 1:
            raise UsageError("--threads must be at least 1")
        if not self.step_modes:
            raise UsageError("--step-modes is empty")
        for mode in self.step_modes:
            options = StepOptions.from_label(mode)
            if options.cuda_graph and not self.device.startswith("cuda"):
                raise UsageError(f"step mode {mode} needs --device cuda")
        if self.repeats < 1:
            raise UsageError("--repeats must be at least 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise UsageError("--batch-sizes must be positive whole numbers (e.g. 1,8)")
        if max(self.batch_sizes) > 1:
            if any(not StepOptions.from_label(mode).eager for mode in self.step_modes):
                raise UsageError("--batch-sizes above 1 run eager steps only (compiled or captured steps run one "
                                 "sequence at a time); use --step-modes eager")
        _gen_config(self.cases()[0])  # validates gen length, steps and block length


def add_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speedups over ``none`` and ``full`` at the same prompt length and batch size, tokens/s over batch size 1's
    of the same method and prompt length (all in the same run), and measured / limit."""
    by_len: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_len.setdefault((row["prompt_len"], row.get("batch_size", 1)), {})[row["method"]] = row
    out = []
    for row in rows:
        row = dict(row)
        peers = by_len[(row["prompt_len"], row.get("batch_size", 1))]
        for ref in ("none", "full"):
            other = peers.get(ref)
            row[f"speedup_vs_{ref}"] = (other["total_s"] / row["total_s"]
                                        if other and row["total_s"] > 0 else None)
        single = by_len.get((row["prompt_len"], 1), {}).get(row["method"])
        row["speedup_vs_batch1"] = (row["tokens_per_s"] / single["tokens_per_s"]
                                    if single and single["tokens_per_s"] > 0 else None)
        runs, single_runs = row.get("tokens_per_s_runs"), (single or {}).get("tokens_per_s_runs")
        if runs and single_runs and len(runs) == len(single_runs) and row.get("batch_size", 1) > 1:
            row["speedup_vs_batch1_runs"] = [b / a for a, b in zip(single_runs, runs, strict=True)]
        lim = row.get("limit_s")
        row["measured_over_limit"] = row["total_s"] / lim if lim else None
        out.append(row)
    return out


def median_row(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Of several runs of one case, the run with the median end-to-end time (the lower middle of an even count:
    every figure of a row comes from one run), with every run's total time and tokens/s in run order."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["total_s"])
    row = dict(runs[order[(len(runs) - 1) // 2]])
    row["repeats"] = len(runs)
    row["total_s_runs"] = [r["total_s"] for r in runs]
    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return row


def run_rounds(cases: Sequence[SpeedCase], run: Callable[[SpeedCase], dict[str, Any]], repeats: int,
               on_case: Callable[[int, int, SpeedCase, dict[str, Any] | None], None] | None = None,
               ) -> dict[str, dict[str, Any]]:
    """Every case ``repeats`` times, round by round (each round runs every case once, in order), so that the runs
    of the cases a ratio compares are spread over the same stretch of the machine's time; each case's median run
    (``median_row``) by key. ``on_case(i, n, case, row)`` as in ``run_sweep``, over all n runs."""
    tell = on_case or (lambda *a: None)
    runs: dict[str, list[dict[str, Any]]] = {case.key(): [] for case in cases}
    total = len(cases) * repeats
    for r in range(repeats):
        for j, case in enumerate(cases):
            i = r * len(cases) + j
            tell(i, total, case, None)
            row = run(case)
            runs[case.key()].append(row)
            tell(i, total, case, row)
    return {key: median_row(rows) for key, rows in runs.items()}


def run_sweep(
    settings: SpeedSettings,
    out: Path | None = None,
    fresh: bool = False,
    isolate: bool = True,
    on_case: Callable[[int, int, SpeedCase, dict[str, Any] | None], None] | None = None,
    runner: Callable[[SpeedCase], dict[str, Any]] | None = None,
) -> tuple[ResultsFolder, list[dict[str, Any]]]:
    """Run (or reuse) every case, write the results folder, return it with the rows (ratios added).

    ``on_case(i, n, case, row)`` is called before a case runs (row None) and after it (its row, with
    ``reused`` true when it came from the folder).
    """
    settings.check()
    cases = settings.cases()
    folder = ResultsFolder.open("speed", settings.as_dict(), [c.key() for c in cases], out, fresh)
    run = runner or (run_case_subprocess if isolate else run_case)
    if settings.repeats > 1:  # the missing cases' runs, round by round, then their median rows into the folder
        medians = run_rounds([c for c in cases if folder.get(c.key()) is None], run, settings.repeats, on_case)

        def tell_reused(i: int, n: int, case: SpeedCase, row: dict[str, Any] | None) -> None:
            if on_case is not None and row is not None and row.get("reused"):  # run_rounds told of the others
                on_case(i, n, case, row)

        reused = folder.run_cases(cases, lambda case: medians[case.key()], tell_reused)
    else:
        reused = folder.run_cases(cases, run, on_case)
    rows = add_ratios(folder.ordered())
    folder.update(rows)
    rows = [{**r, "reused": r["key"] in reused} for r in rows]
    folder.write_text("summary.md", summary_markdown(settings, rows, folder))
    note = write_plot(rows, folder.path / "speed.png")
    if note:
        folder.write_text("summary.md", summary_markdown(settings, rows, folder, note))
    return folder, rows


# ----- child process entry point ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    return case_main(argv, "maskkv_cli.bench.speed", lambda text: run_case(SpeedCase.from_json(text)))


if __name__ == "__main__":
    raise SystemExit(main())
