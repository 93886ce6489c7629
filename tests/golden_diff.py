"""What moved between two recordings of the golden outputs: the paths of the values that differ."""

from __future__ import annotations

from typing import Any


def moved_paths(old: Any, new: Any, path: str = "") -> list[str]:
    """Paths (``a/b/3/c``) where ``new`` differs from ``old``: a changed value, a key or item only in one."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            where = f"{path}/{key}" if path else str(key)
            if key not in new:
                out.append(f"{where} (removed)")
            elif key not in old:
                out.append(f"{where} (added)")
            else:
                out.extend(moved_paths(old[key], new[key], where))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            out.extend(moved_paths(a, b, f"{path}/{i}"))
        return out
    if old != new or type(old) is not type(new):
        return [f"{path}: {_short(old)} -> {_short(new)}"]
    return []


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
