"""Pictures of a ``ProfileReport``: Rich renderables for the terminal and a matplotlib PNG (the HTML page is
``render_html.py``).

The numbers come from ``maskkv_cli.reports.profile_report``; this module only draws them. Colours come from one
fixed ramp (viridis, 9 steps) everywhere; a terminal without colours gets the same levels as characters (``.:-=+*#%@``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from maskkv_cli.errors import MaskKVError
from maskkv_cli.models.catalog import empty_note, is_embedded_model, model_label
from maskkv_cli.policies.base import uses_importance
from maskkv_cli.reports.answers import answer_line, context_line, under_cut
from maskkv_cli.reports.pagemap import OUTSIDE, PageCount, group_pages
from maskkv_cli.reports.profile_report import ProfileReport, RunProfile, quantize
from maskkv_cli.runtime.fileio import atomic_write_bytes, open_file_mode
from maskkv_cli.runtime.sizes import human_size

RAMP = ("#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725")
GLYPHS = ".:-=+*#%@"  # the same levels without colour
EIGHTHS = " ▏▎▍▌▋▊▉"
MAX_PAGE_ROWS = 40
PLOT_HINT = "--plot needs matplotlib, an optional extra: pip install 'maskkv[plot]'"


class MissingExtra(MaskKVError):
    """An optional dependency is not installed."""


# ------------------------------------------------------------------------------------------------ helpers


def seconds_text(seconds: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``, ``2.5`` -> ``"2.50 s"`` (the terminal and the HTML report write times alike)."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def ratio_text(value: float, base: float) -> str:
    """``value`` as a multiple of the first row's ``base`` (``"x0.42"``); empty when either is not positive."""
    return f"x{value / base:.2f}" if base > 0 and value > 0 else ""


def bar(fraction: float, width: int) -> str:
    """A horizontal bar of ``fraction`` (0..1) of ``width`` cells, in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (EIGHTHS[part] if part else "")).ljust(width)


def number_text(value: float) -> str:
    """A budget or a count: whole numbers without decimals, others with two."""
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def write_report(path: Path, data: bytes) -> Path:
    """Write a report (HTML, PNG) atomically, with the permissions of an ordinary file (not mkstemp's 0600)."""
    return atomic_write_bytes(path, data, mode=open_file_mode())


# ------------------------------------------------------------------------------------------------ terminal


def runs_table(report: ProfileReport) -> Table:
    """One row per run; the second line of a cell is the ratio to the first row."""
    from rich import box

    first = report.runs[0]
    title = (f"{len(report.runs)} run(s), prompt {first.prompt_len} tokens, full prompt KV cache "
             f"{human_size(first.stats.kv_full_bytes, binary=True)}; second lines: ratio to the first row")
    table = Table(title=title, title_justify="left", caption=f"{timing_note(report)}\n{report.memory_note}",
                  caption_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for name, justify in (("run", "left"), ("prefill", "right"), ("step", "right"), ("tok/s", "right"),
                          ("total", "right"), ("peak mem", "right"), ("KV kept", "right"), ("smaller", "right"),
                          ("conf.", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]  # (narrow: a cell wraps, nothing is cut)
    base = first.stats
    for i, run in enumerate(report.runs):
        s = run.stats

        def cell(text: str, value: float, ref: float, i: int = i) -> Text:
            out = Text(text)
            if i:
                out.append(f"\n{ratio_text(value, ref)}", style="dim")
            return out

        label = Text()
        label.append(run.spec.label, style="bold")
        if not run.evicted and (run.spec.budget is not None or run.spec.ratio is not None):
            label.append("\nkeeps all", style="dim")
        table.add_row(label, cell(seconds_text(s.prefill_s), s.prefill_s, base.prefill_s),
                      cell(seconds_text(s.median_step_s), s.median_step_s, base.median_step_s),
                      cell(f"{s.tokens_per_s:.1f}", s.tokens_per_s, base.tokens_per_s),
                      cell(f"{s.total_s:.2f} s", s.total_s, base.total_s),
                      cell(human_size(s.peak_mem_bytes, binary=True), s.peak_mem_bytes, base.peak_mem_bytes),
                      cell(human_size(s.kv_bytes, binary=True) if s.kv_bytes else "no cache", s.kv_bytes,
                           base.kv_bytes),
                      f"{s.compression:.1f}x" if s.kv_bytes else "-",
                      confidence_cell(run.row))
    return table


def confidence_cell(row: dict) -> Text:
    """The answer's lowest token probability (the statistic of the LOW CONFIDENCE cut), red and marked when under
    it; ``n/a`` for the embedded model asked a question of another form, ``-`` for no answer."""
    conf = row.get("confidence")
    if row.get("claim") == "untrained-question":
        return Text("n/a")
    if not conf:
        return Text("-")
    if conf["low"]:  # rounded down as the answers' line rounds it: 0.945 is no 0.95
        return Text(f"LOW {under_cut(conf['min']):.2f}", style="bold red")
    return Text(f"{conf['min']:.2f}")


def timing_note(report: ProfileReport) -> str:
    """What the times include: the model's load and the warm-up run are one-time costs, outside the table."""
    load = f"model load {seconds_text(report.load_s)}; " if report.load_s is not None else ""
    if report.warmup_s is None:
        return (f"{load}no warm-up (--no-warmup): the first row includes one-time costs (thread pools, allocator, "
                "kernel choice)")
    return (f"{load}warm-up: {report.runs[0].spec.label} ran once on this prompt first ({seconds_text(report.warmup_s)}"
            ", one-time costs included), not in the table")


def heatmap(matrix: Sequence[Sequence[float]], title: str, unit: str, color: bool, max_width: int,
            layers: Sequence[int] | None = None) -> Text:
    """Layers x heads as coloured cells (two characters a cell when they fit in ``max_width``, else one); ``layers``:
    the model's index of each row (default 0, 1, ...)."""
    levels, lo, hi = quantize(matrix, len(RAMP))
    heads = len(matrix[0]) if matrix else 0
    labels = list(layers) if layers is not None else list(range(len(matrix)))
    row_label = max(2, len(str(max(labels, default=0)))) + 2
    cw = 2 if row_label + 2 * heads <= max_width else 1
    out = Text()
    out.append(f"{title}\n", style="bold")
    header = [" "] * (heads * cw)
    step = 4 if cw == 2 else 8
    for h in range(0, heads, step):
        for j, ch in enumerate(str(h)):
            if h * cw + j < len(header):
                header[h * cw + j] = ch
    out.append(" " * row_label + "".join(header).rstrip() + "  head\n", style="dim")
    for layer, row in zip(labels, levels, strict=True):
        out.append(f"L{layer}".rjust(row_label - 1) + " ", style="dim")
        for level in row:
            if color:
                out.append(" " * cw, style=f"on {RAMP[level]}")
            else:
                out.append(GLYPHS[level] * cw)
        out.append("\n")
    out.append(" " * row_label + f"min {number_text(lo)} ")
    for i in range(len(RAMP)):
        if color:
            out.append("  ", style=f"on {RAMP[i]}")
        else:
            out.append(GLYPHS[i])
    out.append(f" max {number_text(hi)}  {unit}")
    return out


def layer_chart(run: RunProfile, width: int = 24) -> RenderableType:
    """Layer importance I(l) and the layer budgets as horizontal bars (budgets only without importance)."""
    budgets = run.layer_budgets or []
    table = Table(box=None, show_header=True, pad_edge=False, title_justify="left",
                  title=Text("layer budgets" + (" and importance I(l)" if run.importance else ""), style="bold"))
    table.add_column("layer", justify="right", style="dim")
    if run.importance:
        table.add_column("I(l)", no_wrap=True)
        table.add_column("", justify="right")
    table.add_column("budget", no_wrap=True)
    table.add_column("", justify="right")
    top_i = max(run.importance or [0.0]) or 1.0
    top_b = max(budgets or [0]) or 1
    for j, (layer, b) in enumerate(zip(run.layer_labels(len(budgets)), budgets, strict=True)):
        cells = [f"L{layer}"]
        if run.importance:
            value = run.importance[j]
            cells += [Text(bar(value / top_i, width), style="magenta"), f"{value:.4f}"]
        cells += [Text(bar(b / top_b, width), style="cyan"), str(b)]
        table.add_row(*cells)
    if run.importance_source == "online":
        why = "I(l) measured on this input (--layer-budgets online)"
    elif run.importance_source == "profile":
        why = "I(l) from the model's calibration profile"
    elif uses_importance(run.spec.policy):
        why = "no calibration profile was used: uniform layer budgets (run `maskkv calibrate` to make one)"
    else:
        why = f"{run.spec.policy} does not use layer importance: layer budgets only"
    return Group(table, Text(why, style="dim"))


def page_chart(run: RunProfile, width: int = 30) -> RenderableType:
    """One bar per page: the share of that page's (token, layer, head) slots that stayed in the cache."""
    pages = run.pages
    if pages is None:
        return Text(f"page map: {run.pages_note}", style="dim")
    total = pages.kept_total or 1
    table = Table(box=None, pad_edge=False, title=Text("where the kept K/V come from", style="bold"),
                  title_justify="left")
    table.add_column("page", justify="right")
    table.add_column("share of its slots kept", no_wrap=True)
    table.add_column("", justify="right")
    table.add_column("entries", justify="right")
    table.add_column("of all", justify="right")
    table.add_column("tokens", justify="right")
    rows: list[tuple[str, PageCount]] = group_pages(pages.pages, MAX_PAGE_ROWS) + [(OUTSIDE, pages.outside)]
    top = max(p.share for _, p in rows) or 1.0
    for label, p in rows:
        table.add_row(label, Text(bar(p.share / top, width), style="green" if label != OUTSIDE else "yellow"),
                      f"{100 * p.share:.1f}%", str(p.kept), f"{100 * p.kept / total:.1f}%", str(p.tokens))
    parts: list[RenderableType] = [table, Text("share: kept entries / (tokens x layers x heads); bars relative to "
                                               "the largest share; of all: share of every kept entry", style="dim")]
    if pages.dropped_tokens:
        parts.append(Text(f"{pages.dropped_tokens} document tokens were cut from the middle to fit the window; "
                          "only what is in the prompt is mapped", style="yellow"))
    elif pages.note:
        parts.append(Text(pages.note, style="yellow"))
    return Group(*parts)


def answer_words(report: ProfileReport, run: RunProfile) -> tuple[str, str | None]:
    """A run's answer on one line as ``ask`` words it (an absence or a guess said for what it is), and the line that
    goes with it (its confidence, what was read, or why there is no answer; None for a run without its row)."""
    shown = answer_line(run.row) if run.row else run.answer
    line = " ".join((shown or "(no answer)").split()) or "(empty)"
    if not run.row:
        return line, None
    return line, context_line(run.row, empty_note("answer", is_embedded_model(report.model)))


def report_renderables(report: ProfileReport, width: int, color: bool) -> list[RenderableType]:
    """Everything ``maskkv profile`` prints, in order."""
    quantized = getattr(report.runs[0].stats, "quantization", "none") if report.runs else "none"
    weights = f", {quantized} weights" if quantized != "none" else ""
    out: list[RenderableType] = [
        Text(f"{report.document['source']}: {report.document['pages']} pages, {report.document['chars']} chars; "
             f"model {model_label(report.model)} on {report.device}{weights}", style="dim"),
        runs_table(report),
    ]
    answers = Text()
    answers.append("answers\n", style="bold")
    for run in report.runs:
        line, context = answer_words(report, run)
        answers.append(f"  {run.spec.label}: ", style="bold")
        answers.append(line + "\n")  # whole: it carries what was read ("pages 3-4 were cut")
        if context is not None:
            answers.append(f"    {context}\n", style="bold red" if context.startswith("LOW") else "dim")
    out.append(answers)
    run = report.focus_run
    if run is None:
        out.append(Text("no run evicted anything (every budget covers the prompt): no heatmap or page map; try "
                        "smaller --budgets", style="yellow"))
        return out
    out.append(Text(f"pictures of {run.spec.label}", style="bold underline"))
    if not run.head_budgets:
        out.append(Text(f"{run.spec.label} keeps no prompt cache: nothing to draw", style="yellow"))
        return out
    labels = run.layer_labels(len(run.head_budgets))
    if run.head_budgets:
        out.append(heatmap(run.head_budgets, f"kept entries per head (layers x {report.heads})", "entries", color,
                           width, labels))
    if run.residual:
        where = ", ".join(f"layer {i}: {', '.join(str(h) for h, on in enumerate(row) if on)}"
                          for i, row in zip(labels, run.residual, strict=True) if any(row))
        out.append(Text(f"diffuse heads with a residual entry (one of their budget): {where}", style="dim"))
    if run.preference:
        out.append(heatmap(run.preference, "P_h: share of the mask queries' attention on the prompt", "P_h",
                           color, min(width, 40 + 6), run.layer_labels(len(run.preference))))
    out.append(layer_chart(run, width=max(8, min(24, (width - 30) // 2))))
    out.append(page_chart(run, width=max(8, min(30, width - 50))))
    return out


def print_report(console: Console, report: ProfileReport) -> None:
    from maskkv_cli.cli.common import print_wide

    color = console.color_system is not None
    for item in report_renderables(report, console.width, color):
        print_wide(console, item)
        console.print()


# ------------------------------------------------------------------------------------------------ PNG


def require_matplotlib() -> None:
    """Fail with the install hint when the ``plot`` extra is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingExtra(PLOT_HINT) from None


def plot_png(report: ProfileReport, path: Path) -> Path:
    """The runs, the heatmaps, the layer chart and the page map as matplotlib subplots; written atomically."""
    require_matplotlib()
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    cmap = ListedColormap(list(RAMP))
    run = report.focus_run
    panels = ["runs"]
    if run is not None:
        panels += ["heads"] if run.head_budgets else []
        panels += ["pref"] if run.preference else []
        panels += ["layers", "pages"]
    ncols = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(6.5 * ncols, 4.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes, panels, strict=False):
        if panel == "runs":
            labels = [r.spec.label for r in report.runs]
            kv = [r.stats.kv_bytes / 2**20 for r in report.runs]
            ax.bar(labels, kv, color=RAMP[3])
            ax.set_ylabel("KV kept (MiB)")
            ax.set_title("runs: KV kept and tokens/s")
            ax.tick_params(axis="x", rotation=30)
            twin = ax.twinx()
            twin.plot(labels, [r.stats.tokens_per_s for r in report.runs], "o-", color=RAMP[7])
            twin.set_ylabel("tokens/s")
        elif panel in ("heads", "pref") and run is not None:
            data = run.head_budgets if panel == "heads" else run.preference
            image = ax.imshow(data, cmap=cmap if panel == "heads" else "viridis", aspect="auto",
                              interpolation="nearest")
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            ax.set_title(f"{run.spec.label}: kept entries per head" if panel == "heads" else "P_h per head")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            _layer_ticks(ax, run.layer_labels(len(data)))
            fig.colorbar(image, ax=ax)
        elif panel == "layers" and run is not None:
            budgets = run.layer_budgets or []
            layers = list(range(len(budgets)))
            ax.barh(layers, budgets, color=RAMP[4], label="layer budget")
            ax.invert_yaxis()
            _layer_ticks(ax, run.layer_labels(len(budgets)))
            ax.set_xlabel("entries per head")
            ax.set_ylabel("layer")
            ax.set_title("layer budgets" + (" and I(l)" if run.importance else " (no layer importance used)"))
            if run.importance:
                twin = ax.twiny()
                twin.plot(run.importance, layers, "o-", color=RAMP[7], label="I(l)")
                twin.set_xlabel("I(l)")
        elif panel == "pages" and run is not None:
            ax.set_title("share of each page's slots kept")
            if run.pages is None:
                ax.text(0.5, 0.5, run.pages_note or "no page map", ha="center", va="center", wrap=True)
                ax.set_axis_off()
                continue
            rows = group_pages(run.pages.pages, MAX_PAGE_ROWS) + [("q/t", run.pages.outside)]
            ax.bar([label for label, _ in rows], [100 * p.share for _, p in rows],
                   color=[RAMP[5]] * (len(rows) - 1) + [RAMP[8]])
            ax.set_ylabel("% kept")
            ax.set_xlabel("page (q/t: question and template)")
            if len(rows) > 12:
                ax.tick_params(axis="x", rotation=90)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return write_report(path, buf.getvalue())


__all__ = ["MissingExtra", "bar", "heatmap", "layer_chart", "page_chart", "plot_png", "print_report",
           "report_renderables", "require_matplotlib", "runs_table", "write_report"]


def _layer_ticks(ax: Any, labels: list[int]) -> None:
    """The y axis of a per-layer panel: whole-number ticks where the rows are layers 0, 1, ...; else each row named
    by the model's layer it is (DiffusionGemma's rows are its full-attention layers only)."""
    from matplotlib.ticker import MaxNLocator

    if labels == list(range(len(labels))):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax.set_yticks(range(len(labels)), [str(layer) for layer in labels])
