"""A batch run's results folder: ``answers.jsonl`` (a row per job), ``config.json`` and ``summary.md``.

``answers.jsonl`` only ever grows by whole lines: each row is one unbuffered ``write`` of a complete line, in the
kernel's hands when ``append`` returns, so a killed driver leaves at most one torn last line, which the next run
drops before it appends. A written row is ``fsync``ed within ``SYNC_INTERVAL_S`` (by a timer, with every row written
meanwhile) and at close, instead of one ``fsync`` a row (about 4 ms here, a sixth of a job's time on the embedded
model): a machine that loses power loses at most the rows of its last second, which the next run answers again.
On opening, rows are reduced to one per key (the last successful one; failed rows of planned jobs are dropped
so the jobs run again) and the file is rewritten atomically if that changed anything. ``config.json`` and
``summary.md`` are written whole (temp file + rename). A lock file keeps two drivers from writing one folder.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from maskkv_cli.errors import UsageError
from maskkv_cli.runtime.fileio import atomic_write_text, open_file_mode

ANSWERS_FILE = "answers.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.md"
LOCK_FILE = ".lock"
SYNC_INTERVAL_S = 1.0  # the longest time a written row waits for its fsync


def read_rows(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The rows of a JSONL file and whether any line was broken (torn by a crash, or not an object)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], False
    rows: list[dict[str, Any]] = []
    broken = bool(data) and not data.endswith(b"\n")
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            broken = True
            continue
        if isinstance(row, dict) and isinstance(row.get("key"), str):
            rows.append(row)
        else:
            broken = True
    return rows, broken


class AnswersFolder:
    """Open with ``open(planned)``; ``finished`` then maps keys to the rows a rerun can skip."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.answers = path / ANSWERS_FILE
        self.finished: dict[str, dict[str, Any]] = {}
        self.rows: dict[str, dict[str, Any]] = {}  # every row on disk, one per key (also other runs' keys)
        self._fd: int | None = None
        self._lock: int | None = None
        self._timer: threading.Timer | None = None  # the pending fsync of the rows written since the last one
        self._sync_lock = threading.Lock()

    def open(self, planned: Iterable[str], names: Mapping[str, Mapping[str, Any]] | None = None) -> AnswersFolder:
        """``planned``: the keys of this run's jobs. ``names``: per key, the fields that name its job in this run
        (its id and document path), written over those of a row kept from an earlier run, where the job had the
        same content, question and settings but may have had another id or place. A failed row of a job this run
        names again (the same id and document) under another key is dropped too: its document was missing or
        damaged then and reads otherwise now (its key came from the path, or from the old bytes), so this run's row
        replaces it."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        wanted = set(planned)
        jobs = {(fields.get("id"), fields.get("document")) for fields in (names or {}).values()}
        on_disk, broken = read_rows(self.answers)
        kept: dict[str, dict[str, Any]] = {}
        for row in on_disk:
            key = row["key"]
            if row.get("error") and (key in wanted or (row.get("id"), row.get("document")) in jobs):
                continue  # a planned job that failed runs again
            if key in kept and not kept[key].get("error") and row.get("error"):
                continue
            kept[key] = row
        renamed = False
        for key, fields in (names or {}).items():
            row = kept.get(key)
            if row is not None and any(row.get(k) != v for k, v in fields.items()):
                kept[key] = {**row, **fields}
                renamed = True
        if broken or renamed or len(kept) != len(on_disk):
            atomic_write_text(self.answers, "".join(_line(row) for row in kept.values()), mode=open_file_mode())
        self.rows = kept
        self.finished = {k: r for k, r in kept.items() if k in wanted and not r.get("error")}
        self._fd = os.open(self.answers, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self

    def _take_lock(self) -> None:
        import fcntl

        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"another maskkv batch is writing {self.path}; wait for it or choose another "
                             "--out") from None
        self._lock = fd

    def append(self, row: dict[str, Any]) -> None:
        """Add one row as a whole line, written before this returns (synced to the disk within
        ``SYNC_INTERVAL_S``, and at ``close``)."""
        if self._fd is None:
            raise RuntimeError("the results folder is not open")
        data = _line(row).encode("utf-8")
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        with self._sync_lock:
            if self._timer is None:
                self._timer = threading.Timer(SYNC_INTERVAL_S, self.sync)
                self._timer.daemon = True
                self._timer.start()
        self.rows[row["key"]] = row

    def sync(self) -> None:
        """Every row written so far on the disk."""
        with self._sync_lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
                if self._fd is not None:
                    os.fsync(self._fd)

    def write_text(self, name: str, text: str) -> Path:
        target = self.path / name
        atomic_write_text(target, text, mode=open_file_mode())  # results to be read, shared: as open() makes them
        return target

    def close(self) -> None:
        self.sync()
        for fd in (self._fd, self._lock):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock = None

    def __enter__(self) -> AnswersFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _line(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False, sort_keys=True, default=str) + "\n"
