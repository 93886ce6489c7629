"""The one atomic write (``runtime/fileio.py``): the target is the old file or the new one, never a mix, and a
failed write leaves no temporary file."""

from __future__ import annotations

from pathlib import Path

import pytest

from maskkv_cli.runtime.fileio import atomic_file, atomic_write_bytes, atomic_write_text, open_file_mode


def test_writes_replaces_and_creates_the_folder(tmp_path: Path) -> None:
    target = tmp_path / "new" / "folder" / "a.txt"
    assert atomic_write_text(target, "first ü\n") == target
    assert target.read_bytes() == "first ü\n".encode()
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.txt"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary_one(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    target.write_text("old")
    for error in (OSError("disk full"), KeyboardInterrupt()):
        with pytest.raises(type(error)), atomic_file(target) as handle:
            handle.write(b"half of the new")
            raise error
        assert target.read_text() == "old"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_permissions_and_temporary_names(tmp_path: Path) -> None:
    private = atomic_write_text(tmp_path / "private.json", "{}")
    assert private.stat().st_mode & 0o777 == 0o600  # mkstemp's mode: files that may hold a user's text
    shared = atomic_write_text(tmp_path / "shared.jsonl", "", mode=0o644)
    assert shared.stat().st_mode & 0o777 == 0o644
    assert 0 <= open_file_mode() <= 0o666
    seen: list[str] = []
    with atomic_file(tmp_path / "entry.json", prefix=".tmp-", suffix=".part") as handle:
        seen = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
        handle.write(b"x")
    assert len(seen) == 1 and seen[0].endswith(".part")
    assert (tmp_path / "entry.json").read_bytes() == b"x"
