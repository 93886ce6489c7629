"""Domain errors raised by the core; the CLI turns them into one-line messages."""

from __future__ import annotations


class MaskKVError(Exception):
    """Base class: an error whose message is meant for the user as it is."""

    exit_code: int = 1


class UsageError(MaskKVError):
    """Bad option values or arguments."""

    exit_code = 2


class ModelLoadError(MaskKVError):
    """A model folder or checkpoint that cannot be used."""


class DocumentError(MaskKVError):
    """A document that cannot be read."""


class OutOfMemory(MaskKVError):
    """The device ran out of memory."""
