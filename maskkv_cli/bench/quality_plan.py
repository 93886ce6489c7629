"""``bench quality``'s plan: the default tasks, lengths, policies and budgets, and the (policy, budget) cases."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from maskkv_cli.errors import UsageError
from maskkv_cli.tasks.synthetic import KINDS

BENCH_KIND = "quality"
DEFAULT_KINDS: tuple[str, ...] = ("niah_single", "niah_multikey")
DEFAULT_LENGTHS: tuple[int, ...] = (256, 512)
DEFAULT_SAMPLES = 50
DEFAULT_POLICIES: tuple[str, ...] = ("full", "maskkv", "maskkv-plus", "snapkv", "pyramidkv", "adakv", "streamingllm",
                                     "random")
DEFAULT_BUDGETS: tuple[int, ...] = (8, 16, 32, 64)
FALLBACK_GENERATION: dict[str, int] = {"gen_length": 16, "steps": 16, "block_length": 16}


# ----- options -------------------------------------------------------------------------------------------------


def is_tasks_file(value: str) -> bool:
    """``--tasks`` names a JSONL file (rather than a comma list of kinds)."""
    return value.strip().lower().endswith(".jsonl") or Path(value).is_file()


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds: list[str] = []
    for part in text.split(","):
        kind = part.strip()
        if not kind:
            continue
        if kind not in KINDS:
            raise UsageError(f"unknown task kind {kind!r} in --tasks; choose from: {', '.join(KINDS)}, or give "
                             "a .jsonl file (LongBench format)")
        if kind not in kinds:
            kinds.append(kind)
    if not kinds:
        raise UsageError(f"--tasks is empty; give task kinds ({', '.join(KINDS)}) or a .jsonl file")
    return tuple(kinds)


@dataclass(frozen=True)
class Case:
    """One (policy, budget) setting; ``budget`` is None for the policies that keep the whole prompt."""

    policy: str
    budget: int | None

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy} B={self.budget}"


def plan_cases(policies: Sequence[str], budgets: Sequence[int]) -> list[Case]:
    """Each non-evicting policy once (budget None), each evicting policy at every budget; order as given."""
    from maskkv_cli.policies.base import get_policy

    cases: list[Case] = []
    for name in policies:
        if get_policy(name).evicts:
            cases.extend(Case(name, budget) for budget in budgets)
        else:
            cases.append(Case(name, None))
    return cases
