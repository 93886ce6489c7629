"""Rich renderables for the CLI: progress from sampler events, and the stats table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def stats_rows(stats: Any) -> list[tuple[str, str]]:
    """(label, value) pairs of one run: timings, memory, KV cache kept vs full."""
    rows = [
        ("policy", stats.policy),
        ("prompt tokens", str(stats.prompt_len)),
        ("prefill (step 0)", f"{stats.prefill_s * 1000:.1f} ms"),
        ("step (median)", f"{stats.median_step_s * 1000:.2f} ms over {max(0, stats.steps_run - 1)} steps"),
        ("end to end", f"{stats.total_s:.2f} s"),
        ("tokens/s", f"{stats.tokens_per_s:.1f}"),
        ("peak memory", f"{human_bytes(stats.peak_mem_bytes)} ({'CUDA' if stats.mem_kind == 'cuda' else 'RSS'})"),
    ]
    if stats.kv_bytes:
        rows.append(("KV cache kept / full", f"{human_bytes(stats.kv_bytes)} / {human_bytes(stats.kv_full_bytes)}"
                     f" ({stats.compression:.1f}x smaller)"))
    else:
        rows.append(("KV cache", "none (whole sequence recomputed each step)"))
    return rows


def stats_table(stats: Any, title: str = "run statistics") -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for label, value in stats_rows(stats):
        table.add_row(label, value)
    return table


class StepProgress:
    """Turns sampler events into a Rich progress bar (on stderr)."""

    def __init__(self, console: Console, total_steps: int, label: str = "denoising") -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, transient=True,
        )
        self.task = self.progress.add_task(label, total=total_steps, info="")

    def __enter__(self) -> StepProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, event: Any) -> None:
        if event.kind == "done":
            return
        info = f"block {event.block + 1}/{event.n_blocks}, {event.masked_left} masked left"
        self.progress.update(self.task, advance=1, info=info,
                             description="prefill" if event.kind == "prefill" else "denoising")
