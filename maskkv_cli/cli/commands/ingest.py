"""``maskkv ingest``: files and folders into the document store, each file on its own.

The per-file rule lives in ``maskkv_cli.documents.ingest``; this module parses options and renders outcomes:
one line per file, failures as ``error: PATH: reason`` on stderr, a summary line, a progress bar
over files on a terminal, or one JSON document with ``--json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any

import typer

from maskkv_cli.cli.common import State, fail, guarded, live_display_on, note
from maskkv_cli.cli.options import JsonOpt, PasswordOpt, QuietOpt, model_option


class FileProgress:
    """A Rich progress bar over files on stderr (current file, pages so far, rate); inert when off."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled and total > 0
        self.pages = 0
        self.done = 0
        self.started = time.perf_counter()
        self.progress: Any = None
        self.task: Any = None
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn("files · {task.fields[pages]} pages · {task.fields[rate]} ·"),
            TimeRemainingColumn(),
            TextColumn("left"),
            console=Console(stderr=True),
            transient=True,
        )
        self.task = self.progress.add_task("", total=total, pages=0, rate="- files/s")

    def __enter__(self) -> FileProgress:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.progress is not None:
            self.progress.stop()

    def start(self, path: Path) -> None:
        if self.progress is not None:
            name = path.name if len(path.name) <= 24 else path.name[:23] + "…"
            self.progress.update(self.task, description=f"{name:24s}")

    def finish(self, pages: int) -> None:
        self.done += 1
        self.pages += pages
        if self.progress is not None:
            rate = self.done / max(time.perf_counter() - self.started, 1e-9)
            self.progress.update(self.task, advance=1, pages=self.pages, rate=f"{rate:.1f} files/s")


def _list(store: Any, as_json: bool) -> None:
    entries = store.list()
    if as_json:
        typer.echo(json.dumps({"documents": [{"sha256": e.sha256, "source": e.source, "kind": e.kind,
                                              "pages": e.pages, "chars": e.chars,
                                              "ingested_at": e.ingested_at} for e in entries]}))
        return
    if not entries:
        typer.echo(f"the store is empty ({store.root})")
    for e in entries:
        typer.echo(f"{e.sha256[:12]}  {e.pages:4d} pages  {e.chars:9d} chars  {e.source}")


def _error_line(outcome: Any) -> str:
    """``error: PATH: reason``, naming the file once: a message that names the path as given is printed as it is,
    one that starts with the file's name gets the path in its place."""
    path, name, message = str(outcome.path), outcome.path.name, str(outcome.error)
    if path in message:
        return f"error: {message}"
    if name and (message.startswith(name + " ") or message.startswith(name + ":")):
        return f"error: {path}{message[len(name):]}"
    return f"error: {path}: {message}"


def _line(outcome: Any) -> str:
    doc = outcome.document
    state = "already in the store" if outcome.status == "already" else "stored"
    pages = f"{len(doc.pages)} page" + ("" if len(doc.pages) == 1 else "s")
    return f"{outcome.path}: {pages}, {doc.n_chars} chars, {outcome.tokens} tokens; {state} as {doc.sha256[:12]}"


def _older_versions(store: Any, doc: Any) -> str | None:
    """A note naming the other stored versions of the file ``doc`` was read from (an edited file ingested again keeps
    the earlier versions), with how to remove them; None when there are none."""
    older = [e for e in store.list() if e.source == doc.source and e.sha256 != doc.sha256]
    if not older:
        return None
    hashes = ", ".join(e.short for e in older)
    return (f"{doc.name}: {len(older)} earlier version(s) of this file are stored too ({hashes}); `maskkv ingest "
            f"--remove {older[0].short}` removes one")


def _tokenizer(model: str | None) -> tuple[Any, str | None]:
    """The tokenizer tokens are counted with, and how to say so: ``--model``'s, else the model ``ask`` uses by default
    (``MASKKV_MODEL``, the config file, else the embedded one), so that both count alike; (None, None) when there is
    none on this machine (tiktoken or an estimate then)."""
    from maskkv_cli.defaults import configured_model
    from maskkv_cli.documents.tokens import folder_tokenizer
    from maskkv_cli.errors import ModelLoadError
    from maskkv_cli.paths import resolve_model_path, shipped_model_folder

    unusable = None  # where a default model that is not there was set (ask refuses it; counting does not need it)
    if model:
        folder = resolve_model_path(model)
    else:
        try:
            configured = configured_model()
            folder = resolve_model_path(configured) if configured else shipped_model_folder()
        except ModelLoadError:
            from maskkv_cli.defaults import model_origin

            folder, unusable = shipped_model_folder(), model_origin()
        if folder is None:
            return None, None
    tokenizer = folder_tokenizer(folder)
    if tokenizer is None:
        from maskkv_cli.prompting import load_tokenizer

        tokenizer = load_tokenizer(folder)
    if model:
        return tokenizer, None
    if unusable:
        return tokenizer, (f"the tokenizer of {folder.name}, since {unusable} names no usable model (ask refuses "
                           "it until it is fixed)")
    return tokenizer, f"the tokenizer of {folder.name} (the model ask uses by default, so ask counts the same)"


@guarded
def ingest(
    paths: Annotated[list[Path] | None, typer.Argument(
        help="PDF, text or Markdown files, or folders (searched recursively for .pdf, .txt and .md files; "
        ".text and .markdown too).", show_default=False)] = None,
    model: Annotated[str | None, model_option("Count tokens with this model's tokenizer (default: the model ask uses "
                                              "by default; tiktoken or an estimate when there is none).", "-m",
                                              show_default=False)] = None,
    password: PasswordOpt = None,
    list_: Annotated[bool, typer.Option("--list", help="List the documents in the store.")] = False,
    remove: Annotated[str | None, typer.Option("--remove", help="Remove a document (sha prefix or file name).",
                                               show_default=False)] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Parse documents once and keep them in the local store (``MASKKV_HOME``) for later commands.

    Each file is handled on its own: a file that cannot be read is named with the reason and the
    next one goes on; the exit code is 1 when any file failed. In folders, files of other types
    and hidden files are skipped. Interrupted runs keep every finished document; run the same
    command again to store the rest.

    Examples:

        maskkv ingest report.pdf notes.md

        maskkv ingest ~/papers --json

        maskkv ingest --list

        maskkv ingest --remove report.pdf
    """
    from maskkv_cli.documents.ingest import FOLDER_HINT, Tally, discover, ingest_all, skipped_outcomes
    from maskkv_cli.documents.store import DocumentStore

    if sum((list_, remove is not None, bool(paths))) > 1:
        raise fail("give files or folders to ingest, --list or --remove: one of them", 2)
    if remove is not None and not remove.strip():
        raise fail("--remove is empty; give a stored document's hash prefix or file name (`maskkv ingest --list` "
                   "shows them)", 2)
    store = DocumentStore()
    if list_:
        _list(store, as_json)
        return
    if remove:
        entry = store.remove(remove)
        done = f"removed {entry.source} ({entry.sha256[:12]})"
        typer.echo(json.dumps({"removed": entry.sha256}) if as_json else done)
        return
    if not paths:
        raise fail("give one or more files or folders to ingest, or --list / --remove", 2)
    tokenizer, counted_by = _tokenizer(model)
    import warnings

    from maskkv_cli.documents.tokens import TokenCountWarning

    warnings.simplefilter("ignore", TokenCountWarning)  # the method is reported once instead

    found = discover(paths)
    if found.skipped:
        many = "file" if len(found.skipped) == 1 else "files"
        note(f"skipped {len(found.skipped)} {many} in the folders that are not {FOLDER_HINT}", quiet, as_json)
    tally = Tally()
    outcomes = []
    methods: set[str] = set()
    interrupted = False
    with FileProgress(len(found.files), live_display_on(quiet, as_json)) as bar:
        try:
            for outcome in ingest_all(store, found.files, password=password, tokenizer=tokenizer,
                                      debug=State.debug, on_start=bar.start):
                tally.add(outcome)
                outcomes.append(outcome)
                doc = outcome.document
                bar.finish(len(doc.pages) if doc else 0)
                if as_json:
                    continue
                if doc is None:
                    sys.stderr.write(_error_line(outcome) + "\n")
                    continue
                methods.add(counted_by or str(outcome.token_method))
                for w in doc.warnings:
                    note(w, quiet, as_json)
                sys.stdout.write(_line(outcome) + "\n")
                note(_older_versions(store, doc), quiet, as_json)
        except KeyboardInterrupt:
            interrupted = True
    for outcome in skipped_outcomes(found):
        tally.add(outcome)
        outcomes.append(outcome)
    left = len(found.files) - tally.counts["stored"] - tally.counts["already"] - tally.failed
    if as_json:
        data: dict[str, Any] = {"documents": [o.as_dict() for o in outcomes], "summary": dict(tally.counts)}
        if interrupted:
            data["interrupted"] = {"files_not_done": left}
        typer.echo(json.dumps(data))
    else:
        if methods:
            note(f"tokens counted with: {'; '.join(sorted(methods))}", quiet, as_json)
        typer.echo(tally.summary())
    if interrupted:
        raise fail(f"interrupted with {left} of {len(found.files)} files not done; finished documents are "
                   "kept: run the same command again to ingest the rest", 130)
    if tally.failed:
        raise typer.Exit(1)
    if not found.files:  # a wrong folder, or one of other kinds of file: a script must see that nothing was stored
        raise fail(f"no document to ingest in {', '.join(map(str, paths))}: maskkv reads {FOLDER_HINT} files", 1)
