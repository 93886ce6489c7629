"""Rich renderables for the CLI: progress from sampler events, and the stats table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from maskkv_cli.runtime.sizes import human_size


def answer_lines(text: str, confidence: Any, what: str, embedded: bool,
                 document: bool = True) -> tuple[str | None, str]:
    """(the text for stdout, or None when there is none; the line that goes with it on stderr): the confidence
    of an answer or summary (a low one advised to be checked in the document, where there is one), or, for an
    empty one, a note saying so instead of a blank line."""
    from maskkv_cli.models.catalog import empty_note

    if not text.strip():
        return None, "note: " + empty_note(what, embedded)
    return text, confidence_line(confidence, f"check the {what} in the document" if document else "")


def confidence_line(conf: Any, advice: str = "check the answer in the document") -> str:
    """One line for the display: the two numbers of a ``sampling.confidence.Confidence``, and a warning when the
    chosen statistic is under the cut (``reports.answers.confidence_words``), with ``advice``."""
    from maskkv_cli.reports.answers import confidence_words

    return confidence_words(conf.as_dict() if conf is not None else None, advice)


def kv_saving(stats: Any) -> str:
    """How much smaller a run's prompt cache is than the full one, for the displays: "(11.4x smaller)", or "(all
    kept)" where nothing was evicted (a full cache, or a budget at least the prompt's length)."""
    if stats.kv_bytes >= stats.kv_full_bytes:
        return "(all kept)"
    return f"({stats.compression:.1f}x smaller)"


def stats_rows(stats: Any) -> list[tuple[str, str]]:
    """(label, value) pairs of one run: timings, memory, KV cache kept vs full."""
    rows = [
        ("policy", stats.policy),
        ("prompt tokens", str(stats.prompt_len)),
        ("prefill (step 0)", f"{stats.prefill_s * 1000:.1f} ms"),
        ("step (median)", f"{stats.median_step_s * 1000:.2f} ms over {max(0, stats.steps_run - 1)} steps"),
        ("end to end", f"{stats.total_s:.2f} s"),
        ("tokens/s", f"{stats.tokens_per_s:.1f}"),
        ("peak memory",
         f"{human_size(stats.peak_mem_bytes, binary=True)} ({'CUDA' if stats.mem_kind == 'cuda' else 'RSS'})"),
    ]
    if stats.kv_bytes:
        rows.append(("KV cache kept / full",
                     f"{human_size(stats.kv_bytes, binary=True)} / {human_size(stats.kv_full_bytes, binary=True)}"
                     f" {kv_saving(stats)}"))
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


class LiveRun:
    """A live panel for ask/summarize/profile: phase, block/step, elapsed, tokens/s, memory, cache size.

    Used as a context manager; call ``phase(name)`` between stages and pass the object as the sampler's
    ``on_event``. Disabled (a no-op) when stderr is not a terminal or the user asked for quiet/JSON output.
    """

    def __init__(self, console: Console, enabled: bool, device: str = "cpu") -> None:
        import time

        self._time = time.perf_counter
        self.console, self.enabled, self.device = console, enabled, device
        self.t0 = self._time()
        self.phase_name = "starting"
        self.detail = ""
        self.tokens_per_s = 0.0
        self.cache = ""
        self.part_label = ""  # "part 2/8, " while a document is read in parts
        self.live: Any = None

    def __enter__(self) -> LiveRun:
        if self.enabled:
            from rich.live import Live

            # the panel itself is the renderable: Live's refresh thread draws it anew 8 times a second, so the
            # elapsed time runs on through a long silent phase (cutting a book into parts) instead of freezing
            self.live = Live(self, console=self.console, refresh_per_second=8, transient=True)
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def _render(self) -> Table:
        from maskkv_cli.runtime.stats import memory_now

        cur, peak, kind = memory_now(self.device)
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        table.add_row("phase", f"{self.phase_name} {self.detail}".strip())
        table.add_row("elapsed", f"{self._time() - self.t0:.1f} s")
        if self.tokens_per_s:
            table.add_row("tokens/s", f"{self.tokens_per_s:.1f}")
        table.add_row("memory",
                      f"{human_size(cur, binary=True)} now, {human_size(peak, binary=True)} peak ({kind.upper()})")
        if self.cache:
            table.add_row("KV cache", self.cache)
        return table

    def __rich__(self) -> Table:
        return self._render()

    def refresh(self) -> None:
        if self.live is not None:
            self.live.refresh()

    def phase(self, name: str, detail: str = "") -> None:
        self.phase_name, self.detail = name, detail
        self.refresh()

    def set_cache(self, text: str) -> None:
        self.cache = text
        self.refresh()

    def part(self, i: int, n: int) -> None:
        """``pipeline.ask``'s ``on_part``: part ``i`` of ``n`` of a document read in parts starts."""
        self.part_label = f"part {i}/{n}, "

    def prompt_ready(self, prompt: Any) -> None:
        """``pipeline.ask``'s ``on_prompt``: the prefill of this many prompt tokens starts."""
        self.phase("prefill", f"{self.part_label}{len(prompt.ids)} prompt tokens")

    def answered(self, answer: Any) -> None:
        """Show how much of the full prompt cache the answer's run kept."""
        stats = answer.result.stats
        if stats.kv_bytes:
            kept, full = human_size(stats.kv_bytes, binary=True), human_size(stats.kv_full_bytes, binary=True)
            self.set_cache(f"{kept} kept of {full}")

    def __call__(self, event: Any) -> None:
        if event.kind == "prefill":
            self.phase_name = "denoising"
        elif event.kind == "done":
            return
        self.detail = f"{self.part_label}block {event.block + 1}/{event.n_blocks}, step {event.step + 1}, " \
                      f"{event.masked_left} masked left"
        done_tokens = event.step + 1
        self.tokens_per_s = done_tokens / event.elapsed_s if event.elapsed_s > 0 else 0.0
        self.refresh()
