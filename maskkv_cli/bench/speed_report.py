"""``bench speed``'s results as text and a picture: the table (shared by summary.md and the terminal), summary.md
and speed.png."""

from __future__ import annotations

import io
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maskkv_cli.bench.results import ResultsFolder
from maskkv_cli.runtime.fileio import atomic_write_bytes, open_file_mode

if TYPE_CHECKING:
    from maskkv_cli.bench.speed_settings import SpeedSettings

__all__ = ["BATCH_COLUMNS", "QUANTIZE_COLUMNS", "batched", "fmt_bytes", "fmt_gflops", "fmt_ratio", "quantized",
           "summary_markdown", "table_rows", "write_plot"]


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


BATCH_COLUMNS = ("batch", "s/seq", "vs batch 1", "cache/seq (model)", "prefill peak (model)")


def batched(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether any row ran more than one sequence at once (the batch columns are shown only then)."""
    return any(r.get("batch_size", 1) > 1 for r in rows)


QUANTIZE_COLUMNS = ("weights", "weights bytes", "step vs unq", "prefill vs unq")


def quantized(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether any row ran quantized weights (the quantization columns are shown only then)."""
    return any(r.get("quantize", "none") != "none" for r in rows)


def table_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and text cells shared by the Markdown summary and the CLI table; the batch columns
    (``BATCH_COLUMNS``) only when some row has a batch size above 1, the quantization columns
    (``QUANTIZE_COLUMNS``: the weights' quantization and bytes, the median step's and the prefill's speedup over
    the unquantized run of the same case) only when some row is quantized. A failed case's row (``error``) shows
    its prompt, method (batch, weights) and, as its note, the cause; every figure "-"."""
    head = ["prompt", "method", "prefill s", "step ms", "total s", "tok/s", "vs none", "vs full",
            "peak mem", "above weights", "KV kept", "limit s", "meas/limit", "prefill GFLOP/s", "note"]
    extra = batched(rows)
    if extra:
        head[2:2] = ["batch"]
        head[7:7] = ["s/seq", "vs batch 1"]
        head[14:14] = ["cache/seq (model)", "prefill peak (model)"]
    body = []
    for r in rows:
        if r.get("error"):  # a failed case: its name and cause, no figures
            cells = ["-"] * len(head)
            cells[0], cells[1], cells[-1] = str(r["prompt_len"]), r["method"], f"failed: {r['error']}"
            if extra:
                cells[2] = str(r.get("batch_size", 1))
            body.append(cells)
            continue
        notes = []
        if r.get("extrapolated"):
            notes.append("extrapolated")
        if r["policy"] not in ("none", "full") and not r.get("evicted", True):
            notes.append("budget >= prompt (= full)")
        if r.get("setup_s"):
            notes.append(f"{r['step_mode']} setup {r['setup_s']:.1f} s (not in total)")
        if r.get("reused"):
            notes.append("reused")
        cells = [
            str(r["prompt_len"]), r["method"], f"{r['prefill_s']:.3f}", f"{r['step_s'] * 1000:.1f}",
            f"{r['total_s']:.2f}", f"{r['tokens_per_s']:.2f}", fmt_ratio(r.get("speedup_vs_none")),
            fmt_ratio(r.get("speedup_vs_full"), 2), fmt_bytes(r["peak_mem_bytes"]),
            fmt_bytes(r.get("peak_above_weights_bytes")), fmt_bytes(r["kv_bytes"]) if r["kv_bytes"] else "-",
            "-" if r.get("limit_s") is None else f"{r['limit_s']:.2f}",
            fmt_ratio(r.get("measured_over_limit"), 2), fmt_gflops(r), ", ".join(notes),
        ]
        if extra:
            batch = r.get("batch_size", 1)
            cells[2:2] = [str(batch)]
            cells[7:7] = [f"{r['total_s'] / batch:.2f}", fmt_ratio(r.get("speedup_vs_batch1"), 2)]
            cells[14:14] = [fmt_bytes(r.get("model_cache_per_sequence_bytes")),
                            fmt_bytes(r.get("model_prefill_peak_bytes"))]
        body.append(cells)
    if quantized(rows):
        at_method, at_note = head.index("method") + 1, head.index("note") + 1
        head[at_note - 1:at_note - 1] = list(QUANTIZE_COLUMNS[1:])
        head[at_method:at_method] = [QUANTIZE_COLUMNS[0]]
        for r, cells in zip(rows, body, strict=True):
            cells[at_note - 1:at_note - 1] = [fmt_bytes(r.get("weights_bytes")),
                                              fmt_ratio(r.get("step_speedup_vs_unquantized"), 2),
                                              fmt_ratio(r.get("prefill_speedup_vs_unquantized"), 2)]
            cells[at_method:at_method] = [r.get("quantize", "none")]
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
    ]
    gemma = [r for r in rows if r.get("family") == "diffusion_gemma"]
    if gemma:
        lines += [
            f"- DiffusionGemma: the gen length rounded up to whole canvases of {gemma[0]['canvas_length']} tokens, "
            f"each running {s.steps} decoder passes (no early stop, no EOS rule, temperature 0); prefill s = the "
            "prompt's encoding and the first decoder pass (where MaskKV's votes cut the full layers), step ms = the "
            "median later pass (a commit's encoding falls into the pass after it), tok/s = generated tokens / total "
            "s; its limit (instead of the line above) = one bare encode of the prompt and one bare pass over the "
            "whole cache, then the later bare passes over the kept entries (the budget per KV head of every full "
            "layer) and the committed canvases' encodes (`bench/speed_gemma.py`); no prefill GFLOP/s",
        ]
    if batched(rows):
        lines += [
            "- batch B: B sequences (distinct random prompts) generated together by `sample_many`, their prefill "
            "and their later steps each one shared forward; prefill s, step ms, total s, KV kept and the limit are the "
            "batch's, tok/s = B x gen length / total s, s/seq = total s / B, vs batch 1 = tok/s over batch 1's of "
            "the same method and prompt length; prefill GFLOP/s = B forwards' FLOPs / prefill s; cache/seq and "
            "prefill peak: the memory model (`engine/batch_memory.py`)",
            "- the batch's limit: one bare prefill of the B prompts, then per later step one bare forward of "
            "the B responses (weights over every sequence's rows at once, attention sequence by sequence over its "
            "own budget + response keys)",
        ]
    if quantized(rows):
        lines.append("- weights: the linear layers and experts quantized (torchao weight-only int8 / int4, "
                     "`models/quantize.py`; int8 in bf16 on the CPU multiplied by PyTorch's int8 kernel, "
                     "`models/int8_matmul.py`) or none; weights bytes as held (packed values, scales and zero points); "
                     "step vs unq / prefill vs unq: the unquantized run's median step / prefill time over this row's "
                     "(same method, prompt and batch; above 1: faster; with repeats, each the median over the runs)")
        for row in rows:
            per_round = row.get("step_speedup_vs_unquantized_runs")
            if per_round:
                prefill = row.get("prefill_speedup_vs_unquantized_runs") or []
                lines.append(f"- {row['method']} {row['quantize']} at prompt {row['prompt_len']} against none, round "
                             "by round: steps " + ", ".join(fmt_ratio(r, 2) for r in per_round)
                             + "; prefill " + ", ".join(fmt_ratio(r, 2) for r in prefill))
    if s.repeats > 1:
        lines.append(f"- every case ran {s.repeats} times, round by round (each round ran every case once, in the "
                     "order of the table); a row is its case's run with the median total time, and vs batch 1 "
                     "compares those median runs")
        for row in rows:
            per_round = row.get("speedup_vs_batch1_runs")
            if per_round:
                lines.append(f"- {row['method']} at prompt {row['prompt_len']}, batch {row['batch_size']} against 1, "
                             "round by round: " + ", ".join(fmt_ratio(r, 2) for r in per_round)
                             + f" (median {fmt_ratio(statistics.median(per_round), 2)})")
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines.append(f"- {len(failed)} case(s) failed (the note says why; each one's stderr is in `logs/<key>.txt` "
                     "of this folder when it ran in a fresh process); a rerun runs them again")
    lines += [
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
    """tokens/s and peak memory vs prompt length, one line per method; a note instead when matplotlib is missing or
    no case finished."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, speed.png was skipped (pip install 'maskkv[plot]')"

    methods: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("error"):  # a failed case has no point to draw
            continue
        batch, weights = r.get("batch_size", 1), r.get("quantize", "none")
        name = r["method"] if batch == 1 else f"{r['method']} batch {batch}"
        methods.setdefault(name if weights == "none" else f"{name} {weights}", []).append(r)
    if not methods:
        return "no case finished, so speed.png was not drawn"
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
    atomic_write_bytes(path, buf.getvalue(), mode=open_file_mode())
    return None
