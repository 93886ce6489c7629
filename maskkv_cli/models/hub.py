"""Fetch a checkpoint from the Hugging Face Hub into the local HF cache: only the files maskkv reads.

Everything goes through ``huggingface_hub``: one revision call (``model_info``) lists the files with their
sizes and pins the commit; each wanted file is then fetched by ``hf_hub_download`` at that commit into the
standard cache layout (``HF_HUB_CACHE``, else ``HF_HOME/hub``), where ``--model ORG/NAME`` finds it. Files
already in the cache are not fetched again; a connection dropped in the middle of a file is resumed with an
HTTP Range request by ``huggingface_hub`` (up to five times in a row); a file cut short by a stopped process is
fetched again from its start on the next pull (``huggingface_hub`` keeps no partial files between runs).

Settings are read from the environment at call time: ``HF_ENDPOINT``, ``HF_TOKEN`` (through
``huggingface_hub``), ``HF_HUB_OFFLINE`` (the cache only), ``HF_HUB_CACHE`` / ``HF_HOME``.
Progress goes to a plain callback; nothing here prints.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maskkv_cli.errors import MaskKVError, ModelLoadError, reason
from maskkv_cli.models.loading import INDEX_FILE, SINGLE_FILE, weight_files
from maskkv_cli.paths import hf_cache_dir
from maskkv_cli.runtime.fileio import atomic_write_text
from maskkv_cli.runtime.sizes import human_size

DEFAULT_ENDPOINT = "https://huggingface.co"
# Everything the loader and the tokenizer read besides the weights; remote code (*.py) and pickled weights
# (*.bin, *.pth) are never fetched.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
              "chat_template.json")
CONFIG_FILE = "config.json"
DISK_MARGIN = 64 * 2**20  # keep this much free beyond the download itself


class HubError(MaskKVError):
    """A pull that cannot go on: gated, missing, offline, unreachable, or not enough disk."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int


@dataclass(frozen=True)
class PullEvent:
    """Progress of a pull. ``kind``: plan (files, total bytes, bytes still to fetch), file (a file starts),
    bytes (``n`` more bytes arrived; negative when a server ignored a Range request and a file restarts),
    done."""

    kind: str
    name: str = ""
    n: int = 0
    total: int = 0
    files: int = 0


@dataclass(frozen=True)
class PullResult:
    repo_id: str
    revision: str
    commit: str
    path: Path
    files: tuple[RemoteFile, ...]
    fetched_bytes: int  # what this pull had to download (0 when everything was cached)
    offline: bool = False  # the cached copy was used without asking the Hub
    note: str = ""  # why (HF_HUB_OFFLINE, or the Hub could not be reached), for the user


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline_mode() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def is_repo_id(text: str) -> bool:
    """``org/name`` (what ``--model`` treats as a Hub id when no such folder exists)."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~")) and " " not in text


def parse_repo(text: str) -> tuple[str, str | None]:
    """``(ORG/NAME, revision or None)`` from a model id or its page's address: ``https://huggingface.co/ORG/NAME``,
    with ``/tree/REV`` (a branch, tag or commit), ``hf.co/...``, or the ``HF_ENDPOINT`` mirror's; a plain id is
    returned as it is. Raises HubError for an address that is not a model's page."""
    from urllib.parse import unquote, urlsplit

    raw = text.strip()
    if "://" not in raw and not raw.startswith(("huggingface.co/", "hf.co/", "www.huggingface.co/")):
        return raw, None
    url = urlsplit(raw if "://" in raw else "https://" + raw)
    hosts = {"huggingface.co", "www.huggingface.co", "hf.co", urlsplit(endpoint()).netloc}
    parts = [unquote(p) for p in url.path.split("/") if p]
    if parts[:1] == ["models"]:
        parts = parts[1:]
    if url.netloc not in hosts or len(parts) < 2 or parts[0] in ("datasets", "spaces"):
        raise HubError(f"{raw} is not the address of a model on the Hugging Face Hub; give ORG/NAME or "
                       f"https://huggingface.co/ORG/NAME")
    revision = parts[3] if len(parts) >= 4 and parts[2] in ("tree", "blob", "resolve") else None
    return f"{parts[0]}/{parts[1]}", revision


def repo_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or hf_cache_dir()) / ("models--" + repo_id.replace("/", "--"))


def pull_command(repo_id: str, revision: str | None = None) -> str:
    return f"maskkv pull {repo_id}" + (f" --revision {revision}" if revision else "")


def cached_snapshot(repo_id: str, revision: str | None = None, cache_dir: Path | None = None) -> Path | None:
    """The cached snapshot of ``repo_id`` at ``revision`` (a branch/tag through ``refs/``, or a commit), when it
    holds a config and every weight file; else None."""
    repo = repo_folder(repo_id, cache_dir)
    rev = revision or "main"
    ref = repo / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snap = repo / "snapshots" / commit
    if not (snap / CONFIG_FILE).is_file():
        return None
    try:
        weight_files(snap)
    except ModelLoadError:
        return None
    return snap


def wanted_files(names: list[str]) -> tuple[list[str], str | None]:
    """(side files present, how the weights are stored: the index file, the single file, or None)."""
    top = {n for n in names if "/" not in n}
    side = [n for n in SIDE_FILES if n in top]
    if INDEX_FILE in top:
        return side, INDEX_FILE
    if SINGLE_FILE in top:
        return side, SINGLE_FILE
    return side, None


def _bar_class(on_bytes: Callable[[int], None]) -> type:
    """A stand-in for the tqdm class ``huggingface_hub`` creates per file: it forwards byte counts."""

    class _Bar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = 0

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            on_bytes(int(n or 0))

        def close(self) -> None:
            return None

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            return None

        def set_description(self, *args: Any, **kwargs: Any) -> None:
            return None

    return _Bar


def free_bytes(folder: Path) -> int:
    """Free space on the disk that holds ``folder`` (or its nearest existing parent)."""
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _translate(exc: Exception, repo_id: str, revision: str | None) -> MaskKVError:
    """One line for what went wrong talking to the Hub, and what to do."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    where = endpoint()
    status = getattr(getattr(exc, "response", None), "status_code", None)
    token = " (the HF_TOKEN set now has no access)" if os.environ.get("HF_TOKEN") else ""
    if isinstance(exc, GatedRepoError):
        return HubError(f"{repo_id} is gated (HTTP {status}): accept its terms at {where}/{repo_id} and set "
                        f"HF_TOKEN to a token of that account{token}")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{repo_id} has no revision {revision!r} on {where}; check --revision")
    if isinstance(exc, RepositoryNotFoundError):  # the Hub answers 401 for a missing repo to a caller without token
        return HubError(f"no model {repo_id} on {where} (HTTP {status or 404}): check the id (ORG/NAME); if it is "
                        f"private, set HF_TOKEN to a token that can read it{token}")
    if isinstance(exc, HfHubHTTPError):
        if status in (401, 403):
            return HubError(f"{repo_id}: access denied (HTTP {status}) by {where}; it may be private or gated: set "
                            f"HF_TOKEN to a token that can read it{token}")
        return HubError(f"{where} answered HTTP {status} for {repo_id}; try again later")
    first = (str(exc).splitlines() or [""])[0]
    from huggingface_hub.errors import LocalEntryNotFoundError

    if isinstance(exc, OSError) and not isinstance(exc, (LocalEntryNotFoundError, ConnectionError)):
        return HubError(f"cannot write {repo_id} into {hf_cache_dir()} ({type(exc).__name__}: {first}); check the "
                        f"disk, or set HF_HUB_CACHE to another folder")
    return HubError(f"cannot reach {where} ({type(exc).__name__}: {first}); check the network connection or "
                    f"HF_ENDPOINT, or copy the model folder here and pass --model PATH")


def _answered(exc: Exception) -> bool:
    """Whether the Hub answered (an HTTP status: missing, gated, denied) rather than could not be reached."""
    from huggingface_hub.errors import HfHubHTTPError

    return isinstance(exc, HfHubHTTPError)


def _have_token() -> bool:
    """Whether huggingface_hub will send a token (HF_TOKEN, or the file ``hf auth login`` writes)."""
    from huggingface_hub import get_token

    try:
        return get_token() is not None
    except Exception:  # a failing token source means no usable token
        return False


def _write_ref(repo: Path, revision: str, commit: str) -> None:
    """Point ``refs/<revision>`` at ``commit`` (atomically), once every file of the snapshot is in place."""
    if revision == commit:
        return
    atomic_write_text(repo / "refs" / revision, commit)


def pull(repo_id: str, revision: str | None = None,
         on_event: Callable[[PullEvent], None] | None = None) -> PullResult:
    """Download ``repo_id`` at ``revision`` (default: main) into the HF cache and return its snapshot folder."""
    if not is_repo_id(repo_id):
        raise HubError(f"{repo_id!r} is not a Hugging Face model id (ORG/NAME)")
    emit = on_event or (lambda e: None)
    cache_dir = hf_cache_dir()
    rev = revision or "main"
    if offline_mode():
        snap = cached_snapshot(repo_id, rev, cache_dir)
        if snap is None:
            raise HubError(f"HF_HUB_OFFLINE is set and {repo_id} ({rev}) is not in the local cache "
                           f"({repo_folder(repo_id, cache_dir)}); unset HF_HUB_OFFLINE on a connected machine and "
                           f"run `{pull_command(repo_id, revision)}`")
        emit(PullEvent("done"))
        return PullResult(repo_id, rev, snap.name, snap, (), 0, offline=True,
                          note="HF_HUB_OFFLINE is set: using the cached copy")

    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(endpoint=endpoint())
    try:
        info = api.model_info(repo_id, revision=rev, files_metadata=True)
    except Exception as exc:
        error = _translate(exc, repo_id, revision)
        snap = None if _answered(exc) else cached_snapshot(repo_id, rev, cache_dir)
        if snap is None:
            raise error from None
        emit(PullEvent("done"))  # the Hub cannot be reached, and the model is cached: that copy is the model
        return PullResult(repo_id, rev, snap.name, snap, (), 0, offline=True,
                          note=f"{endpoint()} cannot be reached ({type(exc).__name__}): using the cached copy, which "
                               "may be older than the Hub's")
    commit = info.sha or rev
    if info.gated and not _have_token() and cached_snapshot(repo_id, commit, cache_dir) is None:
        raise HubError(f"{repo_id} is gated: accept its terms at {endpoint()}/{repo_id} and set HF_TOKEN to a token "
                       f"of that account")
    sizes = {s.rfilename: int(s.size or (s.lfs.size if s.lfs else 0) or 0) for s in info.siblings or []}
    if CONFIG_FILE not in sizes:
        raise HubError(f"{repo_id} has no {CONFIG_FILE}: it is not a model checkpoint maskkv can load")
    side, weights = wanted_files(list(sizes))
    if weights is None:
        others = sorted(n for n in sizes if n.endswith((".bin", ".pth", ".pt", ".gguf")))
        raise HubError(f"{repo_id} has no {SINGLE_FILE} or {INDEX_FILE}"
                       + (f" (only {', '.join(others[:3])})" if others else "")
                       + "; maskkv loads safetensors checkpoints only")
    repo = repo_folder(repo_id, cache_dir)
    snap = repo / "snapshots" / commit

    def fetch(name: str) -> Path:
        if not (snap / name).exists():
            emit(PullEvent("file", name, total=sizes.get(name, 0)))
        try:
            path = hf_hub_download(repo_id, name, revision=commit, cache_dir=cache_dir, endpoint=endpoint(),
                                   tqdm_class=_bar_class(lambda n: emit(PullEvent("bytes", name, n))))
        except Exception as exc:
            raise _translate(exc, repo_id, revision) from None
        return Path(path)

    shards: list[str] = [weights]
    if weights == INDEX_FILE:
        try:
            weight_map = json.loads(fetch(INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HubError(f"{repo_id}: cannot read {INDEX_FILE}: {reason(exc)}") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if s not in sizes]
        if missing:
            raise HubError(f"{repo_id}: {INDEX_FILE} lists files the repository does not have: {', '.join(missing)}")
    # Weights first and config.json last: a snapshot folder with a config is a complete one.
    order = [s for s in shards if s != INDEX_FILE] + side + [CONFIG_FILE]
    files = tuple(RemoteFile(n, sizes.get(n, 0)) for n in ([INDEX_FILE] if weights == INDEX_FILE else []) + order)
    todo = [f for f in files if not (snap / f.name).exists()]
    need = sum(f.size for f in todo)
    if need:
        folder_free = free_bytes(cache_dir)
        if need + DISK_MARGIN > folder_free:
            raise HubError(f"not enough free disk space for {repo_id}: it needs {human_size(need)} in {cache_dir}, "
                           f"which has {human_size(folder_free)} free; free some space or set HF_HUB_CACHE to a "
                           f"larger disk")
    emit(PullEvent("plan", total=sum(f.size for f in files), n=need, files=len(todo)))
    for name in order:
        fetch(name)
    _write_ref(repo, rev, commit)
    emit(PullEvent("done"))
    return PullResult(repo_id, rev, commit, snap, files, need)
