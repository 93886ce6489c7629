"""Atomic file writes: the one way maskkv writes a file that another run, or a crash, may see half-written.

The data goes to a temporary file in the target's own folder (so the rename never crosses a file system), is
flushed and fsynced, and then ``os.replace`` puts it over the target in one step: a reader sees the old file or
the new one, never a mix. On any failure (an exception, KeyboardInterrupt) the temporary file is removed.

A leaf: it imports nothing from maskkv.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "atomic_write_bytes", "atomic_write_text", "open_file_mode"]


def open_file_mode() -> int:
    """The permissions ``open()`` gives a new file (0o666 less the umask); ``mkstemp`` gives 0o600."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, mode: int | None = None, prefix: str | None = None,
                suffix: str = ".tmp") -> Iterator[BinaryIO]:
    """A binary handle whose content replaces ``path`` when the block ends without an error.

    ``path``'s folder is created if missing. ``mode``: the file's permissions (default: ``mkstemp``'s 0o600, for
    files that may hold a user's text). ``prefix``/``suffix``: the temporary file's name (default
    ``.<name>.<random>.tmp``), for callers that clean up temporary files a dead writer left behind.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}." if prefix is None else prefix, suffix=suffix,
                                     dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (see ``atomic_file``); returns the path."""
    with atomic_file(path, mode=mode) as handle:
        handle.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, mode: int | None = None) -> Path:
    """Write ``text`` as UTF-8 to ``path`` atomically (see ``atomic_file``); returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)
