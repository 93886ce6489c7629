"""Domain errors raised by the core; the CLI turns them into one-line messages."""

from __future__ import annotations

from pathlib import Path


def reason(exc: BaseException) -> str:
    """What went wrong, for a message that already names the file: an OS error's own words ("No such file or
    directory", without its number and the path again), else the error's text (a decoding error's position)."""
    return getattr(exc, "strerror", None) or str(exc)


class MaskKVError(Exception):
    """Base class: an error whose message is meant for the user as it is."""

    exit_code: int = 1


class UsageError(MaskKVError):
    """Bad option values or arguments."""

    exit_code = 2


class ModelLoadError(MaskKVError):
    """A model folder or checkpoint that cannot be used."""


class ModelNotDownloaded(ModelLoadError):
    """``--model ORG/NAME`` that is neither a folder nor in the local HF cache; ``maskkv pull`` can fetch it."""

    def __init__(self, repo_id: str, searched: Path) -> None:
        super().__init__(f"model {repo_id!r} is not on this machine (not a folder, not in the Hugging Face cache "
                         f"{searched}); download it with `maskkv pull {repo_id}`")
        self.repo_id = repo_id
        self.searched = searched


class DocumentError(MaskKVError):
    """A document that cannot be read."""


class OutOfMemory(MaskKVError):
    """The device ran out of memory."""
