"""``maskkv pull`` (fetch a checkpoint from the Hugging Face Hub), ``maskkv models`` (what is on this machine),
and the offer to pull a ``--model ORG/NAME`` that is not on disk yet."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from maskkv_cli.cli.commands.common import fail, guarded
from maskkv_cli.cli.options import JsonOpt, QuietOpt


class _PullDisplay:
    """A Rich byte progress bar on a terminal; one line per file elsewhere (nothing with --quiet / --json)."""

    def __init__(self, quiet: bool, as_json: bool) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.silent = quiet or as_json
        self.live = not self.silent and self.console.is_terminal
        self.progress: Any = None
        self.task: Any = None
        self.pending = 0  # bytes that arrived before the plan (the shard index)

    def __enter__(self) -> _PullDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, event: Any) -> None:
        if self.silent:
            return
        if event.kind == "plan":
            if not self.live:
                self.console.print(f"{event.files} files to download, {_human(event.n)}" if event.files else
                                   "every file is already in the cache")
                return
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
                                     transient=True)
            self.progress.start()
            self.task = self.progress.add_task("pull", total=max(1, event.n))
        elif event.kind == "file" and self.progress is not None:
            self.progress.update(self.task, description=event.name)
        elif event.kind == "file" and not self.live and self.task is None and event.name:
            self.console.print(f"  {event.name}")
        elif event.kind == "bytes" and self.progress is not None:
            self.progress.update(self.task, advance=event.n)


def _human(n: float) -> str:
    from maskkv_cli.models.hub import human_size

    return human_size(n)


def run_pull(repo_id: str, revision: str | None, quiet: bool, as_json: bool) -> Any:
    from maskkv_cli.models.hub import pull as hub_pull

    with _PullDisplay(quiet, as_json) as display:
        return hub_pull(repo_id, revision, on_event=display)


@guarded
def pull(
    repo_id: Annotated[str, typer.Argument(help="Hugging Face model id, ORG/NAME.", show_default=False)],
    revision: Annotated[str | None, typer.Option("--revision", "-r", help="Branch, tag or commit [default: main].",
                                                 show_default=False)] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Download a checkpoint from the Hugging Face Hub into the local HF cache, where `--model ORG/NAME` finds it.

    Only what maskkv reads is fetched: config.json, generation_config.json, tokenizer files, the chat template
    and the safetensors weights (never remote code, never .bin/.pth). Files already cached are skipped, so an
    interrupted pull continues where it stopped. HF_TOKEN (gated models), HF_ENDPOINT (a mirror),
    HF_HUB_OFFLINE (cache only) and HF_HUB_CACHE / HF_HOME (where) are respected.

    Examples:

        maskkv pull GSAI-ML/LLaDA-8B-Instruct

        maskkv pull Dream-org/Dream-v0-Instruct-7B --revision main

        HF_TOKEN=hf_... maskkv pull GSAI-ML/LLaDA-1.5
    """
    result = run_pull(repo_id, revision, quiet, as_json)
    if as_json:
        typer.echo(json.dumps({"repo_id": result.repo_id, "revision": result.revision, "commit": result.commit,
                               "path": str(result.path), "downloaded_bytes": result.fetched_bytes,
                               "offline": result.offline,
                               "files": [{"name": f.name, "size": f.size} for f in result.files]}))
        return
    if result.offline:
        what = "HF_HUB_OFFLINE is set: using the cached copy"
    elif result.fetched_bytes:
        what = f"downloaded {_human(result.fetched_bytes)}"
    else:
        what = "already in the cache, nothing downloaded"
    if not quiet:
        typer.echo(f"{repo_id} ({result.commit[:12]}): {what}", err=True)
        typer.echo(f"use it with --model {repo_id}" + (f" (revision {revision}: --model {result.path})"
                                                       if revision and revision != "main" else ""), err=True)
    typer.echo(str(result.path))


@guarded
def models(as_json: JsonOpt = False) -> None:
    """List the checkpoints on this machine: the embedded model, folders given to --model before, and models
    in the Hugging Face cache, with family, size, dtype and whether each loads (or why not).

    Examples:

        maskkv models

        maskkv models --json
    """
    from maskkv_cli.models.catalog import local_models

    found = local_models()
    if as_json:
        typer.echo(json.dumps({"models": [m.as_dict() for m in found]}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("model", "family", "params", "size", "dtype", "loads"):
        table.add_column(col)
    for m in found:
        params = f"{m.params / 1e9:.2f}B" if m.params and m.params >= 1e8 else (f"{m.params / 1e6:.1f}M"
                                                                              if m.params else "-")
        table.add_row(m.name, m.family or "-", params, _human(m.size_bytes), m.dtype or "-",
                      "yes" if m.loadable else f"no: {m.problem}")
    Console(width=max(100, Console().width)).print(table)
    if not any(m.source == "hf-cache" for m in found):
        from maskkv_cli.defaults import PULL_HINT

        typer.echo(f"no model in the Hugging Face cache yet: `{PULL_HINT}` fetches one", err=True)


def ensure_model(model: str, yes: bool, quiet: bool, as_json: bool) -> None:
    """Make sure ``--model`` is on this machine: a folder is remembered for ``maskkv models``; an ORG/NAME id not
    in the cache is pulled with --yes or after asking on a terminal, else the error gives the pull command."""
    from pathlib import Path

    from maskkv_cli.models.loading import ModelNotDownloaded, resolve_model_path

    try:
        folder = resolve_model_path(model)
    except ModelNotDownloaded as exc:
        interactive = sys.stdin.isatty() and sys.stderr.isatty() and not as_json
        if not yes and interactive:
            yes = typer.confirm(f"{exc.repo_id} is not on this machine. Download it now (`maskkv pull "
                                f"{exc.repo_id}`)?", default=False, err=True)
        if not yes:
            raise fail(f"model {exc.repo_id} is not on this machine; download it with `maskkv pull {exc.repo_id}` "
                       f"(or add --yes to download it now)") from None
        run_pull(exc.repo_id, None, quiet, as_json)
        return
    from maskkv_cli.models.catalog import shipped_model
    from maskkv_cli.models.loading import hf_cache_dir
    from maskkv_cli.paths import maskkv_home

    shipped = shipped_model()
    own = [hf_cache_dir().resolve(), maskkv_home().resolve()]  # the cache and maskkv's own demo models
    inside = any(root in folder.resolve().parents for root in own)
    if Path(model).expanduser().is_dir() and not inside and (shipped is None or
                                                             folder.resolve() != shipped.resolve()):
        from maskkv_cli.models.catalog import remember_folder

        try:
            remember_folder(folder)
        except OSError:
            pass  # the list is a convenience; a read-only home must not stop a run
