"""Checkpoints on this machine: the embedded model, folders given to ``--model`` before, and the HF cache; and which
one a run uses when ``--model`` is not given (``resolve_default_model``).

Each entry says its family, parameter count, size on disk, dtype and whether it can be loaded (config, key
table and tokenizer checked from the files' headers, no tensor is read), or why not.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from maskkv_cli.defaults import PULL_HINT, REAL_MODEL, configured_model, model_origin
from maskkv_cli.errors import MaskKVError, ModelLoadError, ModelNotDownloaded
from maskkv_cli.models.checkpoint import ModelFolder
from maskkv_cli.models.loading import check_checkpoint, check_prequantized, read_config, scan_shapes, weight_files
from maskkv_cli.models.prequantized import read_prequantized
from maskkv_cli.paths import VOCABULARY_FILES, hf_cache_dir, maskkv_home, shipped_model_folder
from maskkv_cli.runtime.fileio import atomic_write_text

REMEMBERED = "models.json"

TINY_RANDOM_NOTE = (
    "no --model given: using the embedded tiny RANDOM model (a demo of the pipeline; its answers are noise). "
    "Point --model (or MASKKV_MODEL) at a LLaDA-8B-Instruct folder for real answers."
)


def shipped_model() -> Path | None:
    """The trained tiny model shipped inside the package, when present."""
    return shipped_model_folder()


def resolve_default_model(model: str | None) -> tuple[str, str | None]:
    """(model path or id, a one-line note to show the user or None). A default model set in ``MASKKV_MODEL`` or the
    config file that is not there fails naming where it was set (an ORG/NAME not downloaded yet is offered for
    pulling by the caller, as ``--model ORG/NAME``)."""
    name, note, _ = default_model(model)
    return name, note


def default_model(model: str | None) -> tuple[str, str | None, ModelFolder | None]:
    """``resolve_default_model``'s name and note, and the ``ModelFolder`` when checking a configured default
    resolved it already (None otherwise: the caller resolves the name, once)."""
    if model:
        return model, None, None
    configured = configured_model()
    if configured:
        try:
            return configured, None, ModelFolder.of(configured)
        except ModelNotDownloaded:
            pass
        except ModelLoadError as exc:
            fix = ("set it to a checkpoint folder or ORG/NAME, unset it" if os.environ.get("MASKKV_MODEL") else
                   "fix or remove that line")
            raise ModelLoadError(f"{model_origin()} names no usable model ({exc}); {fix}, or pass --model") from None
        return configured, None, None
    shipped = shipped_model()
    if shipped is not None:
        return str(shipped), ("no --model given: using the embedded tiny LLaDA (trained here to find needle facts "
                              "in text and copy lead summaries; it cannot chat). For real answers: "
                              f"`{PULL_HINT}`, then --model {REAL_MODEL}."), None
    from maskkv_cli.models.demo import tiny_random_model

    return str(tiny_random_model()), TINY_RANDOM_NOTE, None


def is_embedded_model(path: str) -> bool:
    """Whether ``path`` is the tiny model shipped in the package (what the empty-answer note talks about)."""
    shipped = shipped_model()
    return shipped is not None and Path(path).resolve() == shipped.resolve()


def model_label(path: str) -> str:
    """How a report names the model: the embedded model as such (its folder inside the installed package says
    nothing to a reader), any other by the path or id it was given."""
    return "the embedded tiny model" if is_embedded_model(path) else path


def empty_note(what: str, embedded: bool) -> str:
    """What to say instead of printing a blank ``what`` ("answer" or "summary"): for the embedded model, what it
    can answer and where a real model comes from. The command line and batch's answer rows both carry it, so it
    sits here, beside the note ``resolve_default_model`` gives, rather than in ``cli/``."""
    text = f"the model gave no {what} (it produced only end-of-text tokens)."
    if embedded:
        text += (" The embedded tiny model looks up needle-style facts, e.g. \"What is the special magic "
                 "number for KEY?\" over text holding \"The special magic number for KEY is 4821.\", and writes "
                 "lead summaries (a part's first sentences, often garbled after the first). For real "
                 f"answers download a real model: `{PULL_HINT}`, then pass --model {REAL_MODEL}.")
    else:
        longer = "a larger --length" if what == "summary" else "a longer --gen-length"  # summarize's own option
        text += f" Try {longer}, more --steps, or a larger --budget."
    return text


@dataclass(frozen=True)
class LocalModel:
    name: str  # what to pass to --model
    path: Path
    source: str  # embedded, folder, hf-cache
    family: str | None = None
    params: int | None = None
    size_bytes: int = 0
    dtype: str | None = None
    problem: str | None = None  # why it cannot be loaded; None when it can
    note: str | None = None  # what the checkpoint holds and maskkv never reads (DiffusionGemma's vision tower)

    @property
    def loadable(self) -> bool:
        return self.problem is None

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "path": str(self.path), "source": self.source, "family": self.family,
                "params": self.params, "size_bytes": self.size_bytes, "dtype": self.dtype,
                "loadable": self.loadable, "problem": self.problem, "note": self.note}


def inspect(folder: Path, name: str, source: str) -> LocalModel:
    """Family, size, dtype of a checkpoint folder and whether it loads, from its config and file headers."""
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors") if p.is_file())
    dtype = None
    try:
        raw = json.loads((folder / "config.json").read_text())
        named = raw.get("torch_dtype") or raw.get("dtype") if isinstance(raw, dict) else None
        dtype = named if isinstance(named, str) else None
    except (OSError, ValueError):
        pass
    try:
        cfg = read_config(folder)
    except MaskKVError as exc:
        return LocalModel(name, folder, source, size_bytes=size, dtype=dtype, problem=str(exc))
    except Exception as exc:  # noqa: BLE001 - any file on disk: a listing names its problem and goes on
        return LocalModel(name, folder, source, size_bytes=size, dtype=dtype,
                          problem=f"unreadable config.json ({type(exc).__name__}: {exc})")
    try:
        pre = read_prequantized(folder)
        check_prequantized(folder, cfg, pre, None)  # a pre-quantized format maskkv does not run is the problem
        params, note = check_checkpoint(cfg, scan_shapes(weight_files(folder), pre is not None)[0], str(folder))
        if pre is not None:
            dtype = f"{dtype or '?'}, {pre.mode} weights (torchao)"
        if not any((folder / t).is_file() for t in VOCABULARY_FILES):
            raise MaskKVError(f"no tokenizer vocabulary ({', '.join(VOCABULARY_FILES)})")
    except MaskKVError as exc:
        return LocalModel(name, folder, source, cfg.family, None, size, dtype, problem=str(exc))
    except (OSError, ValueError) as exc:  # safetensors raises these for damaged files
        return LocalModel(name, folder, source, cfg.family, None, size, dtype, problem=f"unreadable weights: {exc}")
    return LocalModel(name, folder, source, cfg.family, params, size, dtype, note=note)


def remembered_folders() -> list[Path]:
    try:
        data = json.loads((maskkv_home() / REMEMBERED).read_text())
    except (OSError, ValueError):
        return []
    folders = data.get("folders", []) if isinstance(data, dict) else []  # (a file of another shape: none)
    return [Path(p) for p in folders if isinstance(p, str)] if isinstance(folders, list) else []


def remember_folder(folder: Path) -> None:
    """Add a checkpoint folder given to ``--model`` to the list ``maskkv models`` shows (atomic write)."""
    folder = folder.resolve()
    known = remembered_folders()
    if folder in known:
        return
    atomic_write_text(maskkv_home() / REMEMBERED, json.dumps({"folders": [str(p) for p in [*known, folder]]}, indent=2))


def cached_repos(cache_dir: Path | None = None) -> list[tuple[str, Path]]:
    """(ORG/NAME, snapshot folder) of each model in the HF cache: the snapshot ``refs/main`` names, else the
    newest one that has a config."""
    root = cache_dir or hf_cache_dir()
    found: list[tuple[str, Path]] = []
    if not root.is_dir():
        return found
    for repo in sorted(root.glob("models--*")):
        repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        snap = snapshots / ref.read_text().strip() if ref.is_file() else None
        if snap is None or not (snap / "config.json").is_file():
            candidates = sorted((p for p in snapshots.iterdir() if (p / "config.json").is_file()),
                                key=lambda p: p.stat().st_mtime)
            if not candidates:
                continue
            snap = candidates[-1]
        found.append((repo_id, snap))
    return found


def local_models() -> list[LocalModel]:
    models: list[LocalModel] = []
    shipped = shipped_model()
    if shipped is not None:
        models.append(inspect(shipped, "(embedded tiny model)", "embedded"))
    for folder in remembered_folders():
        if folder.is_dir() and (folder / "config.json").is_file():
            models.append(inspect(folder, str(folder), "folder"))
    for repo_id, snap in cached_repos():
        models.append(inspect(snap, repo_id, "hf-cache"))
    return models
