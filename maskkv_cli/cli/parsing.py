"""Option values as the commands take them: comma lists of counts, ratios and policy names; the profile's runs.

One parser per kind of value, shared by every command, so the same option reads the same way and fails with
the same message everywhere. Errors are ``UsageError`` (exit code 2) naming the option.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from maskkv_cli.defaults import DEFAULT_BUDGET
from maskkv_cli.errors import UsageError, reason
from maskkv_cli.runtime.devices import check_device

if TYPE_CHECKING:  # parse_runs builds them; importing the report module loads torch
    from maskkv_cli.reports.profile_report import RunSpec


def split_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_count(text: str, option: str = "") -> int:
    """``1024``, ``1k`` (1024), ``1.5k``, ``32K`` -> a positive whole count."""
    where = f"{option}: " if option else ""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(k?)", text.strip().lower())
    if not m:
        raise UsageError(f"{where}not a count: {text.strip()!r} (use positive whole numbers, e.g. 4096 or 4k)")
    value = float(m.group(1)) * (1024 if m.group(2) else 1)
    if value != int(value) or value <= 0:
        raise UsageError(f"{where}not a positive whole count: {text.strip()!r}")
    return int(value)


def parse_counts(text: str, option: str, unique: bool = False, example: str = "64,256") -> tuple[int, ...]:
    """A comma list of counts (``64,256``, ``1k,2k``); ``unique`` drops repeats, keeping the first; ``example``: a
    value of the option for the message of an empty one."""
    counts = tuple(parse_count(part, option) for part in split_list(text))
    if not counts:
        raise UsageError(f"{option} is empty; give e.g. {option} {example}")
    return tuple(dict.fromkeys(counts)) if unique else counts


def parse_ratios(text: str, option: str = "--ratio") -> tuple[float, ...]:
    """A comma list of shares in (0, 1], repeats dropped."""
    out: list[float] = []
    for part in split_list(text):
        try:
            number = float(part)
        except ValueError:
            raise UsageError(f"{option} takes numbers in (0, 1] separated by commas, got {part!r}") from None
        if not 0.0 < number <= 1.0:
            raise UsageError(f"{option} values must be in (0, 1], got {part}")
        out.append(number)
    if not out:
        raise UsageError(f"{option} is empty; give e.g. {option} 0.1,0.5")
    return tuple(dict.fromkeys(out))


def parse_policies(text: str, option: str = "--policies") -> tuple[str, ...]:
    """A comma list of known policy names (``policies.base.check_policy``), repeats dropped, order kept."""
    from maskkv_cli.policies.base import check_policy

    names = tuple(dict.fromkeys(split_list(text)))
    if not names:
        raise UsageError(f"{option} is empty; give comma-separated policy names, e.g. full,maskkv")
    for name in names:
        check_policy(name, f"{option}: ")
    return names


def unwritable(folder: Path) -> str | None:
    """Why no file can be made in the existing ``folder`` (the OS's reason), or None where one can: a probe file is
    made there and removed at once (permission bits alone miss a read-only or virtual file system for root)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as exc:
        return reason(exc)


def writable_folder(folder: Path, what: str, hint: str) -> Path:
    """``folder``, made where missing, when a file can be written in it; else a one-line error naming ``what`` goes
    there and the OS's reason, with ``hint`` (checked before a command's work, not when its result is saved)."""
    from maskkv_cli.errors import MaskKVError

    try:
        folder.mkdir(parents=True, exist_ok=True)
        why = unwritable(folder)
    except OSError as exc:
        why = reason(exc)
    if why is not None:
        raise MaskKVError(f"cannot write {what} in {folder} ({why}); {hint}")
    return folder


def out_folder(path: Path | None, option: str = "--out") -> Path | None:
    """``path``, where a results folder can be made or reused: a file in its place, or in the place of a folder
    above it, a folder that cannot be made there (a read-only or virtual file system) or one that is not writable
    is a usage error (before anything runs, not when the first result is written). Nothing is left on disk: the
    folders made to find out are removed again."""
    if path is None:
        return None
    missing: list[Path] = []
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                raise UsageError(f"{option} {path}: {place} is a file, not a folder; give another path")
            break
        missing.append(place)
    if not missing:
        if unwritable(path) is not None:
            raise UsageError(f"{option} {path}: the folder is not writable; give another path")
        return path
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot make the folder ({reason(exc)}); give another path") from None
    finally:
        for made in missing:  # deepest first: each one is empty once the one below it is gone
            if made.is_dir():
                try:
                    made.rmdir()
                except OSError:
                    break
    return path


def parse_runs(policies: str, budgets: str | None, ratios: str | None) -> list[RunSpec]:
    """``maskkv profile``'s runs: ``--policies a,b`` x (``--budgets 64,256`` or ``--ratio 0.1,0.5``), in that order.

    A policy that never evicts (``full``, ``none``) runs once whatever the budgets.
    """
    from maskkv_cli.policies.base import REGISTRY
    from maskkv_cli.reports.profile_report import RunSpec

    names = parse_policies(policies)
    if budgets is not None and ratios is not None:
        raise UsageError("give either --budgets or --ratio, not both")
    values: list[tuple[int | None, float | None]]
    if ratios is not None:
        values = [(None, r) for r in parse_ratios(ratios)]
    else:
        values = [(b, None) for b in parse_counts(budgets if budgets is not None else str(DEFAULT_BUDGET),
                                                  "--budgets", unique=True)]
    specs: list[RunSpec] = []
    for name in names:
        if not REGISTRY[name].evicts:
            specs.append(RunSpec(name))
            continue
        specs.extend(RunSpec(name, budget, ratio) for budget, ratio in values)
    return specs


def choose_focus(specs: Sequence[RunSpec], choice: str) -> int:
    """Index of the run named by ``--heatmap POLICY@BUDGET`` (or ``POLICY`` for full/none)."""
    wanted = choice.strip()
    for i, spec in enumerate(specs):
        if spec.label == wanted:
            return i
    policy, at, value = wanted.partition("@")
    same = [i for i, s in enumerate(specs) if s.policy == policy]
    if not at and len(same) == 1:
        return same[0]
    for i in same:
        spec = specs[i]
        try:
            if spec.budget is not None and spec.budget == int(value):
                return i
            if spec.ratio is not None and spec.ratio == float(value):
                return i
        except ValueError:
            continue
    labels = ", ".join(s.label for s in specs)
    raise UsageError(f"--heatmap {wanted} is not one of the runs ({labels}); write POLICY@BUDGET")


def parse_devices(devices: str | None, workers: int | None, ray: str | None) -> tuple[str, ...]:
    """``--devices``/``--workers`` as one device name per worker process (empty: run in this process)."""
    if devices is not None and not devices.strip(", "):  # ('' ran in this process, as if not given)
        raise UsageError("--devices is empty; give e.g. cuda:0,cuda:1")
    if devices and workers:
        raise UsageError("give --devices or --workers, not both")
    if workers is not None and workers <= 0:
        raise UsageError(f"--workers must be a positive number, got {workers}")
    if ray:
        if devices:
            raise UsageError("--devices is for one machine; with --ray, Ray places one actor per GPU")
        return ()
    if devices:
        names = tuple(d.strip() for d in devices.split(",") if d.strip())
        for name in names:
            check_device(name)
        return names
    return ("cpu",) * workers if workers else ()
