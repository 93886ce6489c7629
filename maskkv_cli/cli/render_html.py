"""``maskkv profile --html``: the report as one self-contained HTML file (inline CSS, no scripts or downloads)."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from maskkv_cli.cli.render_profile import (
    MAX_PAGE_ROWS,
    RAMP,
    answer_words,
    confidence_cell,
    number_text,
    ratio_text,
    seconds_text,
    write_report,
)
from maskkv_cli.models.catalog import model_label
from maskkv_cli.reports.pagemap import OUTSIDE, group_pages
from maskkv_cli.reports.profile_report import ProfileReport, RunProfile, quantize
from maskkv_cli.runtime.sizes import human_size

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}
table.runs{border-collapse:collapse}table.runs td,table.runs th{border:1px solid #ccc;padding:4px 8px;
text-align:right}table.runs td:first-child{text-align:left;font-weight:bold}
.ratio{color:#888;font-size:.85em;display:block}
table.heat{border-collapse:collapse}table.heat td{width:14px;height:14px;padding:0}
table.heat th{font-weight:normal;color:#888;font-size:.75em;padding:0 4px}
.bar{display:inline-block;height:12px;vertical-align:middle}
.chart td{padding:1px 6px;font-size:.9em}.dim{color:#888}.note{color:#a60}
.legend span{display:inline-block;width:16px;height:12px}
"""


def _heat_html(matrix: Sequence[Sequence[float]], title: str, layers: Sequence[int]) -> str:
    """Layers x heads as a coloured table; ``layers``: the model's index of each row."""
    levels, lo, hi = quantize(matrix, len(RAMP))
    heads = len(matrix[0]) if matrix else 0
    head = "".join(f"<th>{h if h % 4 == 0 else ''}</th>" for h in range(heads))
    body = []
    for layer, row, vals in zip(layers, levels, matrix, strict=True):
        cells = "".join(f'<td style="background:{RAMP[lv]}" title="layer {layer}, head {h}: {number_text(v)}"></td>'
                        for h, (lv, v) in enumerate(zip(row, vals, strict=True)))
        body.append(f"<tr><th>L{layer}</th>{cells}</tr>")
    legend = "".join(f'<span style="background:{c}"></span>' for c in RAMP)
    return (f'<h2>{html.escape(title)}</h2><table class="heat"><tr><th></th>{head}</tr>{"".join(body)}</table>'
            f'<p class="legend">min {number_text(lo)} {legend} max {number_text(hi)}</p>')


def _bar_html(fraction: float, color: str, width: int = 240) -> str:
    px = round(max(0.0, min(1.0, fraction)) * width)
    return f'<span class="bar" style="width:{px}px;background:{color}"></span>'


def _confidence_html(row: dict) -> str:
    """The confidence cell, as the terminal's table shows it (``LOW`` in red under the cut)."""
    cell = confidence_cell(row) if row else None
    text = cell.plain if cell is not None else "-"
    style = " class='note'" if text.startswith("LOW") else ""
    return f"<td{style}>{html.escape(text)}</td>"


def _answer_html(report: ProfileReport, run: RunProfile) -> str:
    """The answer as the terminal's answers section words it (``answer_words``), with the line that goes with it."""
    e = html.escape
    if not run.row:
        return f"<td style='text-align:left'>{e(run.answer)}</td>"
    shown, context = answer_words(report, run)
    style = "note" if context and context.startswith("LOW") else "dim"
    return (f"<td style='text-align:left'>{e(shown)}<span class='{style}' style='display:block'>{e(context or '')}"
            "</span></td>")


def report_html(report: ProfileReport) -> str:
    """A self-contained page (inline CSS, HTML tables for the pictures, the JSON data embedded)."""
    e = html.escape
    base = report.runs[0].stats
    rows = []
    for i, run in enumerate(report.runs):
        s = run.stats

        def td(text: str, value: float, ref: float, i: int = i) -> str:
            extra = f'<span class="ratio">{ratio_text(value, ref)}</span>' if i else ""
            return f"<td>{e(text)}{extra}</td>"

        kv = (f"{human_size(s.kv_bytes, binary=True)} / {human_size(s.kv_full_bytes, binary=True)}" if s.kv_bytes
              else "no cache")
        rows.append(f"<tr><td>{e(run.spec.label)}</td>{td(seconds_text(s.prefill_s), s.prefill_s, base.prefill_s)}"
                    f"{td(seconds_text(s.median_step_s), s.median_step_s, base.median_step_s)}"
                    f"{td(f'{s.tokens_per_s:.1f}', s.tokens_per_s, base.tokens_per_s)}"
                    f"{td(f'{s.total_s:.2f} s', s.total_s, base.total_s)}"
                    f"{td(human_size(s.peak_mem_bytes, binary=True), s.peak_mem_bytes, base.peak_mem_bytes)}"
                    f"{td(kv, s.kv_bytes, base.kv_bytes)}<td>{f'{s.compression:.1f}x' if s.kv_bytes else '-'}</td>"
                    f"{_confidence_html(run.row)}{_answer_html(report, run)}</tr>")
    doc = report.document
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>maskkv profile: {e(Path(str(doc['source'])).name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>maskkv profile: {e(str(doc['source']))}</h1>",
        f"<p class='dim'>{doc['pages']} pages, {doc['chars']} chars; model {e(model_label(report.model))} on "
        f"{e(report.device)}; question: {e(report.question)}</p>",
        "<h2>runs</h2><table class='runs'><tr><th>run</th><th>prefill</th><th>step</th><th>tokens/s</th>"
        "<th>end to end</th><th>peak memory</th><th>KV kept / full</th><th>smaller</th><th>confidence</th>"
        "<th>answer</th></tr>",
        *rows, "</table>", f"<p class='dim'>{e(report.memory_note)}; ratios against the first row</p>",
    ]
    parts += [f"<p class='note'>{e(n)}</p>" for n in report.notes]
    run = report.focus_run
    if run is None:
        parts.append("<p class='note'>no run evicted anything: no heatmap or page map</p>")
    else:
        if run.head_budgets:
            parts.append(_heat_html(run.head_budgets, f"{run.spec.label}: kept entries per head (layers x heads)",
                                    run.layer_labels(len(run.head_budgets))))
        if run.preference:
            parts.append(_heat_html(run.preference, "P_h: share of the mask queries' attention on the prompt",
                                    run.layer_labels(len(run.preference))))
        budgets = run.layer_budgets or []
        top_b = max(budgets or [0]) or 1
        top_i = max(run.importance or [0.0]) or 1.0
        parts.append("<h2>layer budgets" + (" and importance I(l)" if run.importance else "") + "</h2>"
                     "<table class='chart'>")
        for j, (layer, b) in enumerate(zip(run.layer_labels(len(budgets)), budgets, strict=True)):
            imp = ""
            if run.importance:
                imp = f"<td>{_bar_html(run.importance[j] / top_i, RAMP[7])} {run.importance[j]:.4f}</td>"
            parts.append(f"<tr><td>L{layer}</td>{imp}<td>{_bar_html(b / top_b, RAMP[3])} {b}</td></tr>")
        parts.append("</table>")
        if not run.importance:
            parts.append("<p class='dim'>no layer importance was used by this run: layer budgets only</p>")
        parts.append("<h2>where the kept K/V come from</h2>")
        if run.pages is None:
            parts.append(f"<p class='dim'>{e(run.pages_note or '')}</p>")
        else:
            parts.append("<table class='chart'><tr><th>page</th><th>share of the page's slots kept</th>"
                         "<th>entries</th><th>tokens</th></tr>")
            for label, p in group_pages(run.pages.pages, MAX_PAGE_ROWS) + [(OUTSIDE, run.pages.outside)]:
                parts.append(f"<tr><td>{e(label)}</td><td>{_bar_html(p.share, RAMP[5])} {100 * p.share:.1f}%</td>"
                             f"<td>{p.kept}</td><td>{p.tokens}</td></tr>")
            parts.append("</table>")
            if run.pages.dropped_tokens:
                parts.append(f"<p class='note'>{run.pages.dropped_tokens} document tokens were cut from the middle; "
                             "only what is in the prompt is mapped</p>")
    data = json.dumps(report.as_dict()).replace("</", "<\\/")
    parts.append(f"<script type='application/json' id='maskkv-profile'>{data}</script></body></html>\n")
    return "\n".join(parts)


def write_html(report: ProfileReport, path: Path) -> Path:
    return write_report(path, report_html(report).encode("utf-8"))

__all__ = ["report_html", "write_html"]
