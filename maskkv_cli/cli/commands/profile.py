"""``maskkv profile``: one input, several policies and budgets, and pictures of what the cache kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from maskkv_cli.cli.common import fail, guarded, live_display_on, note, note_once, report_console
from maskkv_cli.cli.options import (
    HeatmapOpt,
    HtmlOpt,
    PasswordOpt,
    PlotOpt,
    ProfileBudgetsOpt,
    ProfileLongOpt,
    ProfilePoliciesOpt,
    RatiosOpt,
    WarmupOpt,
)
from maskkv_cli.cli.parsing import unwritable
from maskkv_cli.cli.run_options import OUTPUT, RunOptions, run_options
from maskkv_cli.defaults import DEFAULT_POLICY
from maskkv_cli.prompting.fit import check_long
from maskkv_cli.runtime.devices import resolve_device

DEFAULT_QUESTION = "Summarize the document."


def _check_output(path: Path | None, option: str) -> None:
    """A usage error, before anything runs, where the report file could not be written: a folder in its place, a
    folder that does not exist, or one where no file can be made (a probe file is made there and removed at once)."""
    if path is None:
        return
    if path.is_dir():
        raise fail(f"{option} {path} is a directory; give a file name", 2)
    if not path.parent.is_dir():
        raise fail(f"{option} {path}: the folder {path.parent} does not exist", 2)
    why = unwritable(path.parent)
    if why is not None:
        raise fail(f"{option} {path}: no file can be written in {path.parent} ({why}); give another path", 2)


def _check_distinct(document: Path, plot: Path | None, html: Path | None) -> None:
    """A usage error where a report would overwrite the document or the other report, or where ``--plot`` names a
    file of another picture format than the PNG it writes."""
    if plot is not None and plot.suffix and plot.suffix.lower() != ".png":
        raise fail(f"--plot {plot}: the picture is a PNG; give a file name ending in .png", 2)
    outputs = [(option, path) for option, path in (("--plot", plot), ("--html", html)) if path is not None]
    for option, path in outputs:
        if path.resolve() == document.resolve():
            raise fail(f"{option} {path} is the document itself; give another file name for the report", 2)
    if len(outputs) == 2 and plot.resolve() == html.resolve():  # type: ignore[union-attr]
        raise fail(f"--plot and --html name the same file {plot}; give each its own", 2)


@guarded
@run_options("layer_budgets", "gen_length", "steps", "block_length", "temperature", "threshold", "seed", "model",
             "device", "dtype", "quantize", "yes", *OUTPUT)
def profile(
    document: Annotated[Path, typer.Argument(help="PDF, text or Markdown file.", show_default=False)],
    question: Annotated[str, typer.Argument(help="The question asked in every run.")] = DEFAULT_QUESTION,
    policies: ProfilePoliciesOpt = DEFAULT_POLICY,
    budgets: ProfileBudgetsOpt = None,
    ratio: RatiosOpt = None,
    long: ProfileLongOpt = "truncate",
    password: PasswordOpt = None,
    heatmap: HeatmapOpt = None,
    plot: PlotOpt = None,
    html: HtmlOpt = None,
    warmup: WarmupOpt = True,
    *,
    opts: RunOptions,
) -> None:
    """Run one or several policies/budgets on the same input: a comparison table, a per-head budget heatmap,
    layer importance and a map of the pages the kept K/V come from.

    Examples:

        maskkv profile report.pdf

        maskkv profile report.pdf "Who signed it?" --policies maskkv,snapkv --budgets 64,256

        maskkv profile book.txt --ratio 0.1,0.3 --heatmap maskkv@0.1 --html report.html --plot report.png

        maskkv profile report.pdf --json > profile.json
    """
    from maskkv_cli.documents.reading import check_source

    check_source(document)  # a wrong path fails at once, before anything heavy is imported or loaded

    from rich.console import Console

    from maskkv_cli.cli.parsing import choose_focus, parse_runs
    from maskkv_cli.cli.render import LiveRun
    from maskkv_cli.cli.render_html import write_html
    from maskkv_cli.cli.render_profile import print_report, require_matplotlib
    from maskkv_cli.documents.store import DocumentStore
    from maskkv_cli.engine.plan import check_layer_budgets
    from maskkv_cli.reports.profile_report import profile_document

    if not question.strip():
        raise fail("the question is empty; write the question after the document", 2)
    check_layer_budgets(opts.layer_budgets)
    check_long(long)
    quiet, as_json = opts.quiet, opts.as_json
    specs = parse_runs(policies, budgets, ratio)
    focus = choose_focus(specs, heatmap) if heatmap is not None else None
    _check_output(plot, "--plot")
    _check_output(html, "--html")
    _check_distinct(document, plot, html)
    if plot is not None:
        require_matplotlib()
    err = Console(stderr=True)
    live_on = live_display_on(quiet, as_json)
    device = resolve_device(opts.device)  # once: the panel reads the memory of the device the session runs on
    with LiveRun(err, live_on, device) as live:
        live.phase("parse", str(document))
        doc, _ = DocumentStore().ingest(document, password=password)
        for w in doc.warnings:
            note(w, quiet, as_json)
        live.phase("load model")
        import time

        started = time.perf_counter()
        from maskkv_cli.app.run_settings import ONE_PROMPT, PROFILES_ONE_PROMPT

        session = opts.load_session(device, policies=[spec.policy for spec in specs], generates={}, long=long,
                                    long_modes=(ONE_PROMPT, PROFILES_ONE_PROMPT))
        load_s = time.perf_counter() - started
        gen = opts.generation(session.generation_defaults)
        live.phase("warm-up")
        report = profile_document(
            session, doc, question, gen, specs, long=long, layer_budgets=opts.layer_budgets, seed=opts.seed,
            focus=focus, warmup=warmup, on_run=lambda i, n, spec: live.phase(f"run {i + 1}/{n}", spec.label),
            on_event=live, on_prompt=live.prompt_ready, on_answer=live.answered,
        )
        report.load_s = load_s
        live.phase("write")
        if plot is not None:
            from maskkv_cli.cli.render_profile import plot_png

            plot_png(report, plot)
        if html is not None:
            write_html(report, html)
    for message in report.notes:
        note_once(message, quiet, as_json)
    if as_json:
        typer.echo(json.dumps(report.as_dict()))
        return
    print_report(report_console(), report)
    for path in (plot, html):
        if path is not None:
            note(f"wrote {path}", quiet, as_json)
