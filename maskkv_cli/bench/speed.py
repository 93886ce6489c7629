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
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from maskkv_cli.bench.ceiling import ceiling_fields
from maskkv_cli.bench.limit import measure_limit, rows_schedule
from maskkv_cli.bench.results import ResultsFolder, atomic_write_bytes, settings_key
from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.errors import MaskKVError, UsageError
from maskkv_cli.models.config import ModelConfig, named_config
from maskkv_cli.models.llada import LLaDA
from maskkv_cli.stats import now, peak_rss_bytes, rss_bytes

WARMUP_PROMPT = 256  # prompt tokens of the warm-up run (or the case's own length when shorter)


class BenchError(MaskKVError):
    """A benchmark case that failed (its process crashed, ran out of memory, or printed no row)."""


# ----- models -----------------------------------------------------------------------------------------------


def random_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, std: float = 0.02) -> LLaDA:
    """Random normal weights of the shape ``cfg``, allocated directly on the device in ``dtype``.

    Built on the meta device and filled in place, so loading never holds a float32 copy or a second buffer
    (the point for an 8B shape on a GPU, and for clean memory readings). Weights do not change speed.
    """
    dev = torch.device(device)
    with torch.device("meta"):
        model = LLaDA(cfg)
    model = model.to(dtype=dtype).to_empty(device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    model.requires_grad_(False)
    return model.eval()


def load_bench_model(config: str | None, model_path: str | None, device: torch.device, dtype: str,
                     seed: int) -> LLaDA:
    from maskkv_cli.models.loading import load_model, parse_dtype

    if model_path:
        return load_model(model_path, device=device, dtype=None if dtype == "auto" else dtype)
    return random_model(named_config(config or "llada-small"), device, parse_dtype(dtype, device), seed)


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def random_prompt(cfg: ModelConfig, length: int, seed: int, device: torch.device, batch: int = 1) -> torch.Tensor:
    """Random token ids (never the mask token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
    ids[ids == cfg.mask_token_id] = (cfg.mask_token_id + 1) % cfg.vocab_size
    return ids.to(device)


# ----- peak memory --------------------------------------------------------------------------------------------


def reset_peak(device: torch.device) -> bool:
    """Start a fresh peak: CUDA allocator stats, or the kernel's peak RSS (Linux ``clear_refs``).

    Returns False when the CPU peak could not be reset (it then counts from the process start).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def read_peak(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def read_current(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return rss_bytes()


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

    def key(self) -> str:
        return settings_key(asdict(self))

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
    from maskkv_cli.sampler import GenerationConfig

    return GenerationConfig(gen_length=gen_length or case.gen_length, steps=steps or case.steps,
                            block_length=min(case.block_length, gen_length or case.gen_length), seed=case.seed)


def _warmup(model: LLaDA, case: SpeedCase, policy: Any, budget: int | None) -> float:
    """A short generation (and limit) at a small length: kernels, allocator and caches warmed up."""
    from maskkv_cli.sampler import generate

    dev = model.device
    t0 = now(dev)
    m = min(case.prompt_len, WARMUP_PROMPT)
    g = _gen_config(case, gen_length=case.block_length, steps=min(4, case.steps))  # one block, a few steps
    prompt = random_prompt(model.config, m, case.seed + 1, dev)
    b = None if budget is None else max(1, min(budget, m // 2))
    generate(model, prompt, g, policy, b, step_options=StepOptions.from_label(case.step_mode))
    if case.limit:
        measure_limit(model, prompt, g, None if not policy.uses_cache else (b if b is not None else m), case.seed)
    return now(dev) - t0


def _run_none(model: LLaDA, prompt: torch.Tensor, gen: Any, policy: Any, timed: int) -> tuple[float, list[float]]:
    """Step 0 and up to ``timed - 1`` more steps of the no-cache sampler; (step 0 seconds, later step seconds)."""
    from maskkv_cli.sampler import generate

    marks: list[float] = []

    def on_event(event: Any) -> None:
        if event.kind in ("prefill", "step"):
            marks.append(event.elapsed_s)
            if len(marks) >= timed:
                raise _Stop

    try:
        generate(model, prompt, gen, policy, None, on_event)
    except _Stop:
        pass
    diffs = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return marks[0], diffs


def run_case(case: SpeedCase) -> dict[str, Any]:
    """Measure one case in this process and return its row (see the module docstring)."""
    from maskkv_cli.policies import get_policy
    from maskkv_cli.sampler import generate

    torch.set_num_threads(case.threads)
    dev = torch.device(case.device)
    if case.prompt_len <= 0:
        raise UsageError("prompt lengths must be positive")
    if case.none_steps < 1:
        raise UsageError("--none-steps must be at least 1")
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
    sched = rows_schedule(gen)
    warm_s = _warmup(model, case, policy, budget) if case.warmup else 0.0
    prompt = random_prompt(cfg, case.prompt_len, case.seed, dev)
    peak_reset = reset_peak(dev)
    base_mem = read_current(dev)
    kv_bytes = kv_entries = 0
    elt = torch.finfo(model.dtype).bits // 8
    kv_full = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * case.prompt_len * elt
    extrapolated = False
    setup_s = 0.0
    if not policy.uses_cache and case.none_steps < len(sched):
        prefill_s, later = _run_none(model, prompt, gen, policy, case.none_steps)
        step_s = statistics.median(later) if later else prefill_s
        total_s = prefill_s + (len(sched) - 1) * step_s
        steps_run, steps_timed, extrapolated = len(sched), 1 + len(later), True
    else:
        result = generate(model, prompt, gen, policy, budget, step_options=StepOptions.from_label(case.step_mode))
        st = result.stats
        setup_s = st.setup_s
        prefill_s, step_s, total_s = st.prefill_s, st.median_step_s, st.total_s
        steps_run = steps_timed = st.steps_run
        kv_bytes, kv_entries, kv_full = st.kv_bytes, st.kv_entries, st.kv_full_bytes
        del result
    peak = read_peak(dev)
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
        "tokens_per_s": case.gen_length / total_s if total_s > 0 else 0.0,
        "steps_run": steps_run,
        "steps_timed": steps_timed,
        "extrapolated": extrapolated,
        "kv_bytes": kv_bytes,
        "kv_entries": kv_entries,
        "kv_full_bytes": kv_full,
        "activation_bytes": max(0, peak - loaded_mem - kv_bytes),  # peak above weights, less the kept cache
        "warmup_s": warm_s,
        "setup_s": setup_s,  # compilation / graph capture of the step, kept out of total_s
        "evicted": bool(policy.evicts and budget is not None and budget < case.prompt_len),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }
    if case.limit:
        keys = None if not policy.uses_cache else (budget if budget is not None else case.prompt_len)
        lim = measure_limit(model, prompt, gen, keys, case.seed)
        row.update(limit_s=lim.total_s, limit_prefill_s=lim.prefill_s, limit_step_s=lim.median_step_s,
                   limit_keys=lim.attention_keys, limit_extrapolated=lim.extrapolated,
                   measured_over_limit=total_s / lim.total_s if lim.total_s > 0 else None)
        row.update(ceiling_fields(model, dev, case.prompt_len, case.gen_length, prefill_s))
    else:
        row.update(limit_s=None, limit_prefill_s=None, limit_step_s=None, limit_keys=None, limit_extrapolated=None,
                   measured_over_limit=None)
    row["wall_s"] = time.time() - started
    return row


def run_in_fresh_process(module: str, case_json: str, threads: int, label: str,
                         timeout: float | None = None) -> dict[str, Any]:
    """Run ``python -m module --case JSON`` in a fresh process with ``threads`` threads; return its JSON row."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", module, "--case", case_json]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{label} ran past {timeout:.0f} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit code {proc.returncode}"
        raise BenchError(f"{label} failed ({why}): {tail}")
    row = json.loads(lines[-1])
    if row.get("error"):
        raise BenchError(f"{label} failed: {row['error']}")
    return row


def run_case_subprocess(case: SpeedCase, timeout: float | None = None,
                        module: str = "maskkv_cli.bench.speed") -> dict[str, Any]:
    """Run ``case`` in a fresh Python process and return the JSON row it prints."""
    return run_in_fresh_process(module, case.to_json(), case.threads,
                                f"case {case.method} at prompt {case.prompt_len}", timeout)


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

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("prompt_lengths", "policies", "budgets", "step_modes"):
            d[k] = list(d[k])
        return d

    def cases(self) -> list[SpeedCase]:
        """For each prompt length (ascending): none, full, then each evicting policy at each budget."""
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
                out.extend(SpeedCase(name, b, m, step_mode=mode, **common)  # type: ignore[arg-type]
                           for mode in modes for b in budgets)
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
        _gen_config(self.cases()[0])  # validates gen length, steps and block length


def add_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speedups over ``none`` and ``full`` at the same prompt length (same run), and measured / limit."""
    by_len: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_len.setdefault(row["prompt_len"], {})[row["method"]] = row
    out = []
    for row in rows:
        row = dict(row)
        peers = by_len[row["prompt_len"]]
        for ref in ("none", "full"):
            other = peers.get(ref)
            row[f"speedup_vs_{ref}"] = (other["total_s"] / row["total_s"]
                                        if other and row["total_s"] > 0 else None)
        lim = row.get("limit_s")
        row["measured_over_limit"] = row["total_s"] / lim if lim else None
        out.append(row)
    return out


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
    reused = folder.run_cases(cases, runner or (run_case_subprocess if isolate else run_case), on_case)
    rows = add_ratios(folder.ordered())
    folder.update(rows)
    rows = [{**r, "reused": r["key"] in reused} for r in rows]
    folder.write_text("summary.md", summary_markdown(settings, rows, folder))
    note = write_plot(rows, folder.path / "speed.png")
    if note:
        folder.write_text("summary.md", summary_markdown(settings, rows, folder, note))
    return folder, rows


# ----- reports ------------------------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_ratio(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def fmt_gflops(row: dict[str, Any]) -> str:
    """The prefill's achieved GFLOP/s and the machine's matmul GFLOP/s measured in the same process."""
    if row.get("prefill_gflops") is None or row.get("matmul_gflops") is None:
        return "-"
    return f"{row['prefill_gflops']:.1f} of {row['matmul_gflops']:.1f}"


def table_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and text cells shared by the Markdown summary and the CLI table."""
    head = ["prompt", "method", "prefill s", "step ms", "total s", "tok/s", "vs none", "vs full",
            "peak mem", "above weights", "KV kept", "limit s", "meas/limit", "prefill GFLOP/s", "note"]
    body = []
    for r in rows:
        notes = []
        if r.get("extrapolated"):
            notes.append("extrapolated")
        if r["policy"] not in ("none", "full") and not r.get("evicted", True):
            notes.append("budget >= prompt (= full)")
        if r.get("setup_s"):
            notes.append(f"{r['step_mode']} setup {r['setup_s']:.1f} s (not in total)")
        if r.get("reused"):
            notes.append("reused")
        body.append([
            str(r["prompt_len"]), r["method"], f"{r['prefill_s']:.3f}", f"{r['step_s'] * 1000:.1f}",
            f"{r['total_s']:.2f}", f"{r['tokens_per_s']:.2f}", fmt_ratio(r.get("speedup_vs_none")),
            fmt_ratio(r.get("speedup_vs_full"), 2), fmt_bytes(r["peak_mem_bytes"]),
            fmt_bytes(r.get("peak_above_weights_bytes")), fmt_bytes(r["kv_bytes"]) if r["kv_bytes"] else "-",
            "-" if r.get("limit_s") is None else f"{r['limit_s']:.2f}",
            fmt_ratio(r.get("measured_over_limit"), 2), fmt_gflops(r), ", ".join(notes),
        ])
    return head, body


def summary_markdown(settings: SpeedSettings, rows: Sequence[dict[str, Any]], folder: ResultsFolder,
                     note: str | None = None) -> str:
    head, body = table_rows(rows)
    s = settings
    what = f"checkpoint `{s.model}`" if s.model else f"random weights of the `{s.config}` shape"
    lines = [
        "# maskkv bench speed",
        "",
        f"- model: {what}, dtype {s.dtype}, device {s.device}, {s.threads} torch thread(s)",
        f"- gen length {s.gen_length}, steps {s.steps}, block length {s.block_length}, seed {s.seed}",
        f"- `none` runs {s.none_steps} step(s) and is extrapolated to all steps when that is fewer",
        "- each case ran in a fresh process; warm-up: " + ("yes" if s.warmup else "no"),
        "- limit = one bare forward over [prompt ; masks] + (steps - 1) bare response forwards over "
        "budget + response keys",
        "- prefill GFLOP/s: the matrix-product FLOPs of one bare forward over [prompt ; masks] / prefill s, 'of' "
        "the machine's ceiling: torch.mm of two n x n matrices in the same dtype, device and threads, measured in "
        "the case's process after its run (median of 7; `bench/ceiling.py`)",
        "- memory: " + ("CUDA max_memory_allocated after a reset" if s.device.startswith("cuda")
                        else "peak resident set (VmHWM) of the case's process, reset after loading and warm-up")
        + "; 'above weights' = peak - memory right after loading",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    lines.append("")
    if note:
        lines += [f"Note: {note}", ""]
    lines.append(f"Rows: `{folder.path / 'results.jsonl'}`.")
    return "\n".join(lines) + "\n"


def write_plot(rows: Sequence[dict[str, Any]], path: Path) -> str | None:
    """tokens/s and peak memory vs prompt length, one line per method; a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, speed.png was skipped (pip install 'maskkv[plot]')"
    import io

    methods: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        methods.setdefault(r["method"], []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rs in methods.items():
        rs = sorted(rs, key=lambda r: r["prompt_len"])
        xs = [r["prompt_len"] for r in rs]
        ax1.plot(xs, [r["tokens_per_s"] for r in rs], marker="o", label=name)
        ax2.plot(xs, [r["peak_mem_bytes"] / 2**30 for r in rs], marker="o", label=name)
    for ax, title, unit in ((ax1, "tokens/s", "tokens/s"), (ax2, "peak memory", "GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return None


# ----- child process entry point ------------------------------------------------------------------------------


def case_main(argv: Sequence[str] | None, prog: str, run: Callable[[str], dict[str, Any]]) -> int:
    """Child-process entry point shared by the benchmarks: ``--case JSON`` in, one JSON row (or error) out."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description="Run one case and print its JSON row.")
    parser.add_argument("--case", required=True, help="the case as JSON")
    args = parser.parse_args(argv)
    try:
        row = run(args.case)
    except MaskKVError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    print(json.dumps(row), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return case_main(argv, "maskkv_cli.bench.speed", lambda text: run_case(SpeedCase.from_json(text)))


if __name__ == "__main__":
    raise SystemExit(main())
