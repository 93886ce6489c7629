"""Results folders of benchmark runs: ``config.json``, ``results.jsonl`` (a row per case), ``summary.md``, plots.

Every file is written atomically (a temporary file in the same folder, then ``os.replace``), and
``results.jsonl`` is rewritten after each finished case, so an interrupted run keeps what it finished. Each row
carries a ``key``: a hash of everything that decides the case's numbers. A re-run with identical settings finds
the folder again (or is pointed at it with ``--out``) and reuses the rows whose key it plans to run; the rows of
cases it does not plan stay in ``results.jsonl``. A folder holding anything else is refused (``check_run_folder``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Self

from maskkv_cli.errors import UsageError
from maskkv_cli.runtime.devices import machine_info
from maskkv_cli.runtime.fileio import atomic_write_text, open_file_mode

RUNS_ROOT = Path("runs")


def mib(n: float | None) -> str:
    """A table cell of ``n`` bytes in MiB with one decimal, or "-" for none."""
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


class JsonCase:
    """A benchmark case (a dataclass) as one line of JSON, as a fresh process receives it."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, text: str) -> Self:
        data = json.loads(text)
        unknown = set(data) - {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if unknown:
            raise UsageError(f"unknown case fields: {', '.join(sorted(unknown))}")
        return cls(**data)


def settings_key(settings: dict[str, Any]) -> str:
    """A short stable hash of JSON-able settings (key order does not matter)."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a missing file is empty and broken lines (a crash mid-write) are skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def find_folder(kind: str, settings: dict[str, Any], root: Path = RUNS_ROOT) -> Path | None:
    """The newest ``root/bench-<kind>-*`` folder whose config.json holds exactly these settings."""
    if not root.is_dir():
        return None
    want = settings_key(settings)
    for folder in sorted(root.glob(f"bench-{kind}-*"), reverse=True):
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(config, dict) and config.get("settings_key") == want:
            return folder
    return None


def new_folder_name(kind: str, root: Path = RUNS_ROOT) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = root / f"bench-{kind}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = root / f"bench-{kind}-{stamp}-{n}"
    return path


def check_run_folder(path: Path, kind: str) -> None:
    """Refuse a folder that holds something other than a ``bench <kind>`` run (another kind of run, a batch's
    answers, files of the user's), whose files opening it would overwrite. A missing or empty folder is fine."""
    if not path.is_dir() or not any(path.iterdir()):
        return
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        config = None
    found = config.get("kind") if isinstance(config, dict) and isinstance(config.get("settings"), dict) else None
    if found != kind:
        held = f"a bench {found} run" if isinstance(found, str) else "files that are not a maskkv bench run"
        raise UsageError(f"{path} holds {held}, which this bench {kind} run would overwrite; choose a new or empty "
                         "--out folder")


class ResultsFolder:
    """One run's folder. ``planned`` is the ordered list of case keys; rows are kept in that order, after them the
    rows of other cases the folder already held (an earlier run of other settings), kept as they were."""

    def __init__(self, path: Path, kind: str, settings: dict[str, Any], planned: Iterable[str],
                 fresh: bool = False) -> None:
        check_run_folder(path, kind)
        self.path = path
        self.kind = kind
        self.settings = settings
        self.planned = list(planned)
        self.rows: dict[str, dict[str, Any]] = {}
        self.others: dict[str, dict[str, Any]] = {}  # rows of cases this run does not plan
        wanted = set(self.planned)
        for row in read_jsonl(path / "results.jsonl"):
            key = row.get("key")
            if not isinstance(key, str):
                continue
            if key not in wanted:
                self.others[key] = row
            elif not fresh and not row.get("error"):
                self.rows[key] = row
        self.reused = len(self.rows)
        config = {"kind": kind, "settings": settings, "settings_key": settings_key(settings),
                  "machine": machine_info(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        atomic_write_text(path / "config.json", json.dumps(config, indent=2, default=str) + "\n",
                          mode=open_file_mode())
        self._write_rows()

    @classmethod
    def open(cls, kind: str, settings: dict[str, Any], planned: Iterable[str], out: Path | None = None,
             fresh: bool = False, root: Path = RUNS_ROOT) -> ResultsFolder:
        """``out`` if given, else the newest folder with identical settings, else a new timestamped one."""
        path = out if out is not None else (None if fresh else find_folder(kind, settings, root))
        return cls(path or new_folder_name(kind, root), kind, settings, planned, fresh)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.rows.get(key)

    def put(self, row: dict[str, Any]) -> None:
        self.rows[row["key"]] = row
        self._write_rows()

    def update(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self.rows[row["key"]] = row
        self._write_rows()

    def run_cases(self, cases: Sequence[Any], run: Callable[[Any], dict[str, Any]],
                  notify: Callable[[int, int, Any, dict[str, Any] | None], None] | None = None) -> set[str]:
        """Run every case (anything with ``key()``) whose row is not here yet, saving each row as it comes;
        returns the keys reused. ``notify(i, n, case, row)`` is called before a case runs (row None) and after
        it (its row, with ``reused`` true when it came from the folder)."""
        tell = notify or (lambda *a: None)
        reused: set[str] = set()
        for i, case in enumerate(cases):
            row = self.get(case.key())
            if row is not None:
                reused.add(row["key"])
                tell(i, len(cases), case, {**row, "reused": True})
                continue
            tell(i, len(cases), case, None)
            row = run(case)
            self.put(row)
            tell(i, len(cases), case, row)
        return reused

    def ordered(self) -> list[dict[str, Any]]:
        return [self.rows[k] for k in self.planned if k in self.rows]

    def _write_rows(self) -> None:
        rows = [*self.ordered(), *self.others.values()]
        text = "".join(json.dumps(row, sort_keys=True, default=str) + "\n" for row in rows)
        atomic_write_text(self.path / "results.jsonl", text, mode=open_file_mode())

    def write_text(self, name: str, text: str) -> Path:
        target = self.path / name
        atomic_write_text(target, text, mode=open_file_mode())
        return target
