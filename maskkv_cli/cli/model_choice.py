"""The model a command runs: the default when ``--model`` is not given, pulling an ``ORG/NAME`` that is not on this
machine (``maskkv pull``, or the offer to when a command names one), and loading it with its tokenizer."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import typer

from maskkv_cli.cli.common import fail, note
from maskkv_cli.runtime.devices import resolve_device

if TYPE_CHECKING:
    from maskkv_cli.models.checkpoint import ModelFolder

__all__ = ["choose_model", "ensure_model", "load_session", "pull_first", "run_pull"]


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
                from maskkv_cli.runtime.sizes import human_size

                self.console.print(f"{event.files} files to download, {human_size(event.n)}" if event.files else
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


def run_pull(repo_id: str, revision: str | None, quiet: bool, as_json: bool) -> Any:
    """Download ``repo_id`` into the HF cache with a progress display (``maskkv pull``, or a command's offer)."""
    from maskkv_cli.models.hub import pull as hub_pull

    with _PullDisplay(quiet, as_json) as display:
        return hub_pull(repo_id, revision, on_event=display)


def ensure_model(model: str, yes: bool, quiet: bool, as_json: bool,
                 folder: ModelFolder | None = None, origin: str | None = None) -> ModelFolder:
    """Make sure ``--model`` is on this machine and resolve it, once: the ``ModelFolder`` the command passes down.
    A folder is remembered for ``maskkv models``; an ORG/NAME id not in the cache is pulled with --yes or after
    asking on a terminal, else the error gives the pull command. ``folder``: ``model`` resolved already;
    ``origin``: where a default model was set (``defaults.model_origin``), named by the error."""
    from pathlib import Path

    from maskkv_cli.errors import ModelNotDownloaded
    from maskkv_cli.models.checkpoint import ModelFolder

    try:
        folder = folder or ModelFolder.of(model)
    except ModelNotDownloaded as exc:
        interactive = sys.stdin.isatty() and sys.stderr.isatty() and not as_json
        if not yes and interactive:
            yes = typer.confirm(f"{exc.repo_id} is not on this machine. Download it now (`maskkv pull "
                                f"{exc.repo_id}`)?", default=False, err=True)
        if not yes:
            named = f" ({origin})" if origin else ""
            raise fail(f"model {exc.repo_id}{named} is not on this machine; download it with `maskkv pull "
                       f"{exc.repo_id}` (or add --yes to download it now)") from None
        run_pull(exc.repo_id, None, quiet, as_json)
        return ModelFolder.of(model)  # the snapshot just pulled
    from maskkv_cli.models.catalog import shipped_model
    from maskkv_cli.paths import hf_cache_dir, maskkv_home

    shipped = shipped_model()
    own = [hf_cache_dir().resolve(), maskkv_home().resolve()]  # the cache and maskkv's own demo models
    resolved = folder.path.resolve()
    inside = any(root in resolved.parents for root in own)
    if Path(model).expanduser().is_dir() and not inside and (shipped is None or resolved != shipped.resolve()):
        from maskkv_cli.models.catalog import remember_folder

        try:
            remember_folder(folder.path)
        except OSError:
            pass  # the list is a convenience; a read-only home must not stop a run
    return folder


def choose_model(model: str | ModelFolder | None, yes: bool, quiet: bool, as_json: bool) -> ModelFolder:
    """``--model``, else the default (saying so when the embedded model is used), made sure to be on this machine
    and resolved (``ensure_model``): the command's one ``ModelFolder``. One given (the command chose it before)
    comes back as it is."""
    from maskkv_cli.models.checkpoint import ModelFolder

    if isinstance(model, ModelFolder):
        return model
    folder, message = pull_first(model, yes, quiet, as_json)
    note(message, quiet, as_json)
    return folder


def pull_first(model: str | None, yes: bool, quiet: bool, as_json: bool) -> tuple[ModelFolder, str | None]:
    """Offer (or, with --yes, run) the pull of a --model ORG/NAME not on disk before a live panel starts: the
    resolved ``ModelFolder`` to load under the panel, and the default model's note to show there (or None)."""
    from maskkv_cli.defaults import model_origin
    from maskkv_cli.models.catalog import default_model

    name, message, folder = default_model(model)
    return ensure_model(name, yes, quiet, as_json, folder, None if model else model_origin()), message


def load_session(model: str | ModelFolder | None, device: str, dtype: str, quiet: bool, as_json: bool,
                 device_map: str | None = None, yes: bool = False, dream: Any = None, quantize: str = "none") -> Any:
    """Choose the model (``choose_model``; ``model`` may be the ``ModelFolder`` chosen before) and load it with its
    tokenizer; ``dream``: Dream's sampler options; ``quantize``: the weights' quantization (none, int8, int4)."""
    from maskkv_cli.app.session import Session

    folder = choose_model(model, yes, quiet, as_json)
    session = Session(folder, device=resolve_device(device), dtype=None if dtype == "auto" else dtype,
                      device_map=device_map, dream=dream, quantize=quantize)
    if device_map == "auto" and getattr(session.model, "layer_devices", None) is None:  # fewer than two GPUs
        import torch

        note(f"--device-map auto: {torch.cuda.device_count()} GPU(s) visible, so the model is not spread over "
             f"devices; it runs on {session.device}", quiet, as_json)
    from maskkv_cli.models.quantize import targets, unquantized_targets

    left = unquantized_targets(session.model)  # type: ignore[arg-type]
    if left:
        shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        dtype_name = str(session.model.dtype).removeprefix("torch.")
        note(f"{quantize}: {len(left)} of {len(targets(session.model))} layers keep their {dtype_name} weights (the "  # type: ignore[arg-type]
             f"int4 kernels pack inputs in groups of 32 and outputs by 16): {shown}", quiet, as_json)
    return session
