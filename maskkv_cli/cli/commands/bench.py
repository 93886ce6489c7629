"""``maskkv bench speed``, ``memory``, ``loading`` and ``reuse``: timings and peak memory, each case in a fresh
process (registered on ``maskkv bench`` in ``cli/app.py``, with ``bench quality`` and ``bench tasks``).

Heavy modules (torch, Rich) load inside the commands, so ``maskkv --help`` stays light.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from maskkv_cli.cli.common import fail, guarded, print_wide, report_console
from maskkv_cli.cli.options import (
    BenchBlockOpt,
    BenchGenOpt,
    BenchModelOpt,
    BenchQuantizeOpt,
    BenchStepsOpt,
    ConfigOpt,
    DeviceOpt,
    DtypeOpt,
    FreshOpt,
    JsonOpt,
    MemoryPoliciesOpt,
    OutOpt,
    PolicyOpt,
    QuietOpt,
    SeedOpt,
    SpeedPoliciesOpt,
    ThreadsOpt,
    budget_option,
    budgets_option,
    config_option,
    device_option,
    quantize_option,
    repeats_option,
)
from maskkv_cli.cli.parsing import out_folder, parse_count, parse_counts, parse_policies, split_list
from maskkv_cli.defaults import check_dtype
from maskkv_cli.errors import UsageError
from maskkv_cli.runtime.devices import resolve_device

CPU_LENGTHS = "1k,2k,4k"
GPU_LENGTHS = "1k,2k,4k,8k,16k,32k"
# Seconds a bench speed case may run on a GPU by default: many times the 15-25 s expected of an 8B case at 32k
# (an estimate, not measured yet), yet short of a lent window, so that one hung case cannot take all of it.
GPU_CASE_TIMEOUT = 300.0


def _progress(quiet: bool, as_json: bool) -> Any:
    def on_case(i: int, n: int, case: Any, row: dict[str, Any] | None) -> None:
        if quiet or as_json:
            return
        batch, weights = getattr(case, "batch_size", 1), getattr(case, "quantize", "none")
        what = (f"[{i + 1}/{n}] prompt {case.prompt_len} {case.method}" + (f" batch {batch}" if batch > 1 else "")
                + (f" {weights}" if weights != "none" else ""))
        if row is None:
            sys.stderr.write(f"{what}: running...\n")
        elif row.get("error"):
            sys.stderr.write(f"{what}: FAILED: {row['error']}\n")
        elif row.get("reused"):
            sys.stderr.write(f"{what}: reused\n")
        else:
            sys.stderr.write(f"{what}: {row.get('total_s', row.get('prefill_s', 0.0)):.2f} s\n")
        sys.stderr.flush()

    return on_case


def _print_table(title: str, head: list[str], body: list[list[str]], keep: tuple[str, ...] | None = None,
                 left: tuple[str, ...] = ("method", "note", "peak reached in")) -> None:
    """A Rich table of the chosen columns; off a terminal it is laid out wide instead of folded to 80."""
    from rich import box
    from rich.table import Table

    cols = [j for j, name in enumerate(head) if keep is None or name in keep]
    console = report_console()
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for j in cols:
        # (in a terminal too narrow for every column a cell folds onto more lines: no value is cut)
        table.add_column(head[j], justify="left" if head[j] in left else "right", overflow="fold")
    for cells in body:
        table.add_row(*(cells[j] for j in cols))
    print_wide(console, table)


SPEED_COLUMNS = ("prompt", "method", "weights", "batch", "prefill s", "step ms", "total s", "tok/s", "s/seq",
                 "vs batch 1", "vs none", "vs full", "peak mem", "KV kept", "cache/seq (model)", "prefill peak (model)",
                 "meas/limit", "prefill GFLOP/s", "weights bytes", "step vs unq", "prefill vs unq", "note")


@guarded
def speed(
    prompt_lengths: Annotated[str | None, typer.Option(
        "--prompt-lengths", help=f"Comma-separated prompt lengths [default: {GPU_LENGTHS} on a GPU, {CPU_LENGTHS} "
        "on the CPU].", show_default=False)] = None,
    policies: SpeedPoliciesOpt = "none,full,maskkv",
    budgets: Annotated[str, budgets_option("Budgets of the evicting policies.")] = "64,256,1024",
    config: ConfigOpt = None,
    model: BenchModelOpt = None,
    gen_length: BenchGenOpt = 128,
    steps: BenchStepsOpt = None,
    block_length: BenchBlockOpt = 32,
    none_steps: Annotated[int, typer.Option(
        "--none-steps", help="Steps `none` runs (step 0 included); its end-to-end time is extrapolated from them.")]
    = 3,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = 1,
    seed: SeedOpt = 0,
    limit: Annotated[bool, typer.Option(
        "--limit/--no-limit", help="Also time the limit line and the machine's matmul ceiling per case.")] = True,
    step_modes: Annotated[str, typer.Option(
        "--step-modes", help="How the cache policies run later steps, each mode a case: eager, compile "
        "(torch.compile), cuda-graph, compile+cuda-graph. One-time compilation/capture is reported apart.")]
    = "eager",
    compile_: Annotated[bool, typer.Option("--compile", help="Shorthand for --step-modes eager,compile (both, in "
                                           "one run).")] = False,
    batch_sizes: Annotated[str, typer.Option(
        "--batch-sizes", help="Comma-separated batch sizes, each a case per method: B sequences of the prompt "
        "length (distinct random prompts) generated together, their prefill and later steps each sharing one "
        "forward; reported per batch (tok/s = B x gen length / total) with the ratio to batch 1. Above 1: eager "
        "steps only, and not for DiffusionGemma shapes (its passes run one sequence at a time).")] = "1",
    repeats: Annotated[int, repeats_option(
        "Run every case this many times, round by round (each round runs every case once), and "
        "report each case's median run; ratios between cases then compare runs spread over the same time.")] = 1,
    quantize: BenchQuantizeOpt = "none",
    in_process: Annotated[bool, typer.Option(
        "--in-process", help="Run every case in this process (quick checks; peak memory is then not per case).")]
    = False,
    case_timeout: Annotated[float | None, typer.Option(
        "--case-timeout", metavar="SECONDS", help="Kill a case's process after this many seconds and record the "
        f"case as failed [default: {GPU_CASE_TIMEOUT:.0f} on a GPU (a hung capture, compile or kernel must not "
        "take a whole lent window), none on the CPU; 0: none].", show_default=False)] = None,
    longest_first: Annotated[bool, typer.Option(
        "--longest-first", help="Run the longest prompt length's cases first (the table keeps ascending order), "
        "so that a short window measures the long prompts before it closes.")] = False,
    out: OutOpt = None,
    fresh: FreshOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Time no cache, full cache and MaskKV budgets over prompt lengths, in one run.

    Per case: prefill, median step, end to end, tokens/s, speedups over `none` and `full`, peak memory, KV bytes,
    the limit (one bare full forward + bare response steps over budget + response keys) and measured / limit.
    DiffusionGemma shapes run their own sampler: the gen length rounded up to whole canvases of fixed passes,
    prefill = the encoder and the first decoder pass, the limit its bare encode and decoder passes over the kept
    entries (docs/performance.md).
    With --batch-sizes: the same per batch of B sequences, the time per sequence, tokens/s against batch size 1,
    and the memory model's cache per sequence and prefill peak.

    A case that fails or runs past --case-timeout leaves an error row (its stderr kept in the results folder's
    logs/) and the sweep goes on; the command then exits with status 1, and a rerun runs only the failed and
    missing cases.

    Examples:

        maskkv bench speed

        maskkv bench speed --config llada-small --prompt-lengths 16k --budgets 256 --policies none,full,maskkv

        maskkv bench speed --device cuda --prompt-lengths 1k,32k --gen-length 256 --steps 256 --json

        maskkv bench speed --device cuda --prompt-lengths 1k,32k --budgets 256 --longest-first --case-timeout 300

        maskkv bench speed --device cuda --step-modes eager,compile+cuda-graph --policies full,maskkv

        maskkv bench speed --prompt-lengths 1k -n 32 --steps 32 --policies maskkv --budgets 256 --batch-sizes 1,8

        maskkv bench speed --prompt-lengths 1k -n 32 --steps 32 --policies maskkv --budgets 256 --batch-sizes 1,8
        --repeats 5

        maskkv bench speed --config llada2-small --prompt-lengths 1k --policies maskkv --budgets 256
        --quantize none,int8,int4 --repeats 5 --in-process

        maskkv bench speed --config diffusiongemma-small --prompt-lengths 1k,4k --budgets 256 --threads 2

        maskkv bench speed --config diffusiongemma-26b-a4b --device cuda --prompt-lengths 32k,128k --budgets 256
    """
    from maskkv_cli.bench.speed import SpeedSettings, run_sweep
    from maskkv_cli.bench.speed_report import table_rows
    from maskkv_cli.bench.speed_settings import GEMMA_STEPS, check_shape, runs_gemma

    dev = resolve_device(device)
    gpu = dev.startswith("cuda")
    shape = None if model else check_shape(config or ("llada-8b" if gpu else "llada-small"))
    settings = SpeedSettings(
        prompt_lengths=parse_counts((GPU_LENGTHS if gpu else CPU_LENGTHS) if prompt_lengths is None else prompt_lengths,
                                    "--prompt-lengths"),
        policies=parse_policies(policies), budgets=parse_counts(budgets, "--budgets"), gen_length=gen_length,
        steps=steps if steps is not None else GEMMA_STEPS if runs_gemma(shape, model) else 128,
        block_length=block_length, config=shape,
        model=model, device=dev, dtype=check_dtype(dtype), none_steps=none_steps, seed=seed, threads=threads,
        limit=limit,
        step_modes=("eager", "compile") if compile_ else tuple(split_list(step_modes)),
        batch_sizes=parse_counts(batch_sizes, "--batch-sizes", unique=True, example="1,8"), repeats=repeats,
        quantize=tuple(split_list(quantize)))
    if case_timeout is not None and case_timeout < 0:
        raise UsageError("--case-timeout must be 0 (none) or a positive number of seconds")
    if in_process and case_timeout:
        raise UsageError("--case-timeout needs fresh processes; leave out --in-process")
    timeout = (GPU_CASE_TIMEOUT if gpu else None) if case_timeout is None else case_timeout or None
    folder, rows = run_sweep(settings, out_folder(out), fresh, isolate=not in_process,
                             on_case=_progress(quiet, as_json), case_timeout=timeout, longest_first=longest_first)
    if as_json:
        typer.echo(json.dumps({"results": rows}))
    else:
        head, body = table_rows(rows)
        _print_table("maskkv bench speed", head, body, SPEED_COLUMNS)
        if not quiet:
            sys.stderr.write(f"results: {folder.path}\n")
    failed = [r for r in rows if r.get("error")]
    if failed:  # after the table: the finished rows are shown and saved, and the exit status says not all ran
        logs = f"their stderr is in {folder.path / 'logs'}" if any(r.get("log") for r in failed) else \
            "their causes are in the table's notes"
        raise fail(f"{len(failed)} of {len(rows)} cases failed; {logs}; rerun the same command to run them again")


@guarded
def memory(
    prompt_length: Annotated[str, typer.Option("--prompt-length", help="Prompt tokens (e.g. 16k).")] = "16k",
    budget: Annotated[int, budget_option("MaskKV budget (entries per head per layer).", "-b")]
    = 256,
    policies: MemoryPoliciesOpt = "full,maskkv",
    config: Annotated[str, config_option("Named model shape with random weights.")]
    = "llada-small",
    model: BenchModelOpt = None,
    gen_length: BenchGenOpt = 128,
    block_length: BenchBlockOpt = 32,
    device: Annotated[str, device_option("cpu (peak RSS) or cuda (allocator peak).")] = "cpu",
    dtype: DtypeOpt = "auto",
    quantize: Annotated[str, quantize_option(
        "Weight quantization of the model: none, int8 or int4 (torchao; the config file's default does not apply "
        "to benchmarks).")] = "none",
    threads: ThreadsOpt = 1,
    seed: SeedOpt = 0,
    profile: Annotated[bool, typer.Option(
        "--profile/--no-profile", help="Peak memory per layer and phase, to show where the peak is reached.")]
    = True,
    out: OutOpt = None,
    fresh: FreshOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Peak memory of a MaskKV prefill against the full cache's, each in a fresh process, minus the weights.

    Two readings: the peak of live tensor bytes (exact, independent of the allocator; used for the target and the
    share of full) and the peak RSS (CUDA: allocator peak), what the OS sees. Target: MaskKV's live peak above
    weights at most 0.2 of the full cache's (reported, not enforced).

    Examples:

        maskkv bench memory

        maskkv bench memory --prompt-length 4k --budget 64 --json
    """
    from maskkv_cli.bench.memory import TARGET_SHARE, MemorySettings, memory_table, run_memory
    from maskkv_cli.models.config import named_config

    if not model:
        named_config(config)  # an unknown shape is a usage error before any case runs
    settings = MemorySettings(prompt_len=parse_count(prompt_length, "--prompt-length"), budget=budget,
                              gen_length=gen_length,
                              block_length=block_length, policies=parse_policies(policies),
                              config=None if model else config, model=model, device=resolve_device(device),
                              dtype=check_dtype(dtype), seed=seed, threads=threads, profile=profile, quantize=quantize)
    folder, rows = run_memory(settings, out_folder(out), fresh, on_case=_progress(quiet, as_json))
    if as_json:
        typer.echo(json.dumps({"results": rows}))
        return
    head, body = memory_table(rows)
    _print_table(f"maskkv bench memory (prompt {settings.prompt_len}, budget {budget})", head, body)
    for r in rows:
        if r.get("target_met") is not None:
            verdict = "met" if r["target_met"] else "MISSED"
            typer.echo(f"{r['method']}: live peak above weights is {r['share_of_full']:.3f} of full's "
                       f"(target <= {TARGET_SHARE:.3f}): {verdict}")
    if not quiet:
        sys.stderr.write(f"results: {folder.path}\n")


@guarded
def loading(
    quantize: BenchQuantizeOpt = "none,int8,int4",
    config: Annotated[str, config_option("Named model shape whose random weights are written as a bf16 checkpoint "
                                         "in shards (removed after the run).")] = "llada2-small",
    model: BenchModelOpt = None,
    shard_mb: Annotated[int, typer.Option("--shard-mb", help="Shard size of the random checkpoint, MiB (a tensor "
                                          "larger than this gets a shard of its own).")] = 256,
    device: Annotated[str, device_option("cpu (peak RSS) or cuda (allocator peak).")] = "cpu",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = 1,
    seed: SeedOpt = 0,
    out: OutOpt = None,
    fresh: FreshOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Peak memory of loading a checkpoint in several shards, unquantized and quantized while loading, each in a
    fresh process, against the target: the weights held + the largest shard.

    Examples:

        maskkv bench loading

        maskkv bench loading --dtype bf16 --quantize int8,int4 --json

        maskkv bench loading --model ~/models/LLaDA2.1-mini --dtype bf16
    """
    from maskkv_cli.bench.loading import LoadSettings, loading_table, run_loading

    settings = LoadSettings(quantize=tuple(split_list(quantize)),
                            config=None if model else config, model=model, shard_mb=shard_mb,
                            dtype=check_dtype(dtype), device=resolve_device(device), seed=seed, threads=threads)

    def on_case(i: int, n: int, case: Any, row: dict[str, Any] | None) -> None:
        if not quiet and not as_json:
            what = f"[{i + 1}/{n}] loading with {case.quantize} weights"
            sys.stderr.write(f"{what}: running...\n" if row is None else f"{what}: "
                             + ("reused\n" if row.get("reused") else f"{row['load_s']:.1f} s\n"))

    folder, rows = run_loading(settings, out_folder(out), fresh, on_case=on_case)
    if as_json:
        typer.echo(json.dumps({"results": rows}))
        return
    head, body = loading_table(rows)
    _print_table("maskkv bench loading", head, body, left=("weights", "dtype", "within", "note"))
    if not quiet:
        sys.stderr.write(f"results: {folder.path}\n")


@guarded
def reuse(
    doc_tokens: Annotated[str, typer.Option("--doc-tokens", help="Tokens of the document (e.g. 4k).")] = "4k",
    questions: Annotated[int, typer.Option("--questions-per-doc", help="Questions asked of the document.")] = 8,
    config: Annotated[str, config_option("Named model shape with random weights: block-causal (llada2-small, "
                                         "llada2-mini) or DiffusionGemma (diffusiongemma-small, "
                                         "diffusiongemma-tiny).")] = "llada2-small",
    budget: Annotated[int, budget_option("Entries per head the policy keeps.", "-b")] = 256,
    policy: PolicyOpt = "maskkv",
    gen_length: BenchGenOpt = 32,
    block_length: BenchBlockOpt = 32,
    repeats: Annotated[int, repeats_option("Runs of each way; the median is reported.")] = 3,
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = 1,
    seed: SeedOpt = 0,
    as_json: JsonOpt = False,
) -> None:
    """One document and several questions on a block-causal model (LLaDA2) or DiffusionGemma: the document computed
    once and reused (LLaDA2's blocks, DiffusionGemma's encoder cache) against every question asked on its own, in one
    run, on the CPU; time, peak live tensor bytes, equal answers.

    Examples:

        maskkv bench reuse

        maskkv bench reuse --doc-tokens 1k --questions-per-doc 4 --repeats 1 --json

        maskkv bench reuse --config diffusiongemma-small --doc-tokens 4k --gen-length 256
    """
    from maskkv_cli.bench.reuse import ReuseCase, run_reuse
    from maskkv_cli.runtime.sizes import human_size

    case = ReuseCase(config=config, doc_tokens=parse_count(doc_tokens, "--doc-tokens"), questions=questions,
                     gen_length=gen_length, block_length=block_length, policy=policy, budget=budget, repeats=repeats,
                     threads=threads, dtype=check_dtype(dtype), seed=seed)
    row = run_reuse(case)
    if as_json:
        typer.echo(json.dumps(row))
        return
    head = ["way", "seconds", "prefill seconds", "peak live tensors"]
    body = [["separate asks", f"{row['separate_s']:.2f}", f"{row['separate_prefill_s']:.2f}",
             human_size(row["separate_peak_bytes"], binary=True)],
            ["document reused", f"{row['reused_s']:.2f}", f"{row['reused_prefill_s']:.2f}",
             human_size(row["reused_peak_bytes"], binary=True)]]
    label = policy if row["budget"] is None else f"{policy}@{budget}"  # (the row has none for none and full)
    _print_table(f"maskkv bench reuse ({config}, {case.doc_tokens}-token document, {questions} questions, "
                 f"{label})", head, body)
    typer.echo(f"speed-up {row['speedup']:.2f}x (prefills {row['prefill_speedup']:.2f}x); stored prefix "
               f"{human_size(row['prefix_bytes'], binary=True)}; "
               f"{row['answers_equal']} of {questions} answers token for token equal")
