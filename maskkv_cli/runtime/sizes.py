"""Byte counts for people: the one formatter of sizes (a leaf)."""

from __future__ import annotations

__all__ = ["human_size"]

_DECIMAL = (1000, ("B", "KB", "MB", "GB", "TB"))
_BINARY = (1024, ("B", "KiB", "MiB", "GiB", "TiB"))


def human_size(n: float, binary: bool = False) -> str:
    """``n`` bytes in the largest unit under which it stays below one step, bytes whole and the rest with one decimal
    (``1.5 MB``). Decimal units (1000, KB..TB) for files and downloads, as the Hub and disks count them; binary
    (1024, KiB..TiB) for memory and the KV cache."""
    step, units = _BINARY if binary else _DECIMAL
    for unit in units[:-1]:
        if abs(n) < step:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= step
    return f"{n:.1f} {units[-1]}"
