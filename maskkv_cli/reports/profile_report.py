"""Profile one input under several KV-cache policies and budgets: the data behind ``maskkv profile``.

Every run answers the same question about the same document in the same process, one after another, and
becomes a ``RunProfile``: the run statistics, the layer budgets, the per-head budgets (layers x heads), the
per-head prompt preference ``P_h`` when the policy computed it, the layer importance ``I(l)`` when the run used
one (a calibration profile or the online measurement), and a ``PageMap``: which pages of the document the kept
prompt K/V entries come from.

The page map is computed in ``pagemap.py``. This module computes data only (lists and numbers); rendering lives
in ``maskkv_cli.cli.render_profile``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from maskkv_cli.documents import Document
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.selection import LayerRecord
from maskkv_cli.errors import UsageError
from maskkv_cli.reports.pagemap import PageMap, map_pages
from maskkv_cli.runtime.stats import RunStats, free_unreachable

__all__ = [
    "ProfileReport",
    "RunProfile",
    "RunSpec",
    "head_budget_matrix",
    "preference_matrix",
    "profile_document",
    "quantize",
    "residual_matrix",
]


# ----------------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunSpec:
    """One policy at one budget (``budget`` or ``ratio``; neither for policies that keep the whole prompt)."""

    policy: str
    budget: int | None = None
    ratio: float | None = None

    @property
    def label(self) -> str:
        if self.budget is not None:
            return f"{self.policy}@{self.budget}"
        if self.ratio is not None:
            return f"{self.policy}@{self.ratio:g}"
        return self.policy


# ------------------------------------------------------------------------------------------------ matrices


def head_budget_matrix(records: Sequence[LayerRecord], row: int = 0) -> list[list[int]]:
    """Kept prompt entries per head: one list per layer (layers x heads), batch row ``row``."""
    return [[int(x) for x in r.head_budgets[row].tolist()] for r in sorted(records, key=lambda r: r.layer)]


def residual_matrix(records: Sequence[LayerRecord], row: int = 0) -> list[list[int]] | None:
    """1 where a head holds a residual entry besides its kept entries (layers x heads); None when no head does."""
    ordered = sorted(records, key=lambda r: r.layer)
    if not any(r.residual is not None and bool(r.residual.any()) for r in ordered):
        return None
    return [[0] * r.head_budgets.shape[1] if r.residual is None else [int(x) for x in r.residual[row].tolist()]
            for r in ordered]


def preference_matrix(records: Sequence[LayerRecord], row: int = 0) -> list[list[float]] | None:
    """``P_h`` per head (layers x heads) when every layer reported it, else None."""
    ordered = sorted(records, key=lambda r: r.layer)
    if not ordered or any(r.preference is None for r in ordered):
        return None
    return [[float(x) for x in r.preference[row].tolist()] for r in ordered]  # type: ignore[index]


def quantize(matrix: Sequence[Sequence[float]], levels: int) -> tuple[list[list[int]], float, float]:
    """Each value as a level in ``0 .. levels-1`` (linear between the matrix's min and max), and (min, max)."""
    values = [v for row in matrix for v in row]
    if not values:
        return [], 0.0, 0.0
    lo, hi = float(min(values)), float(max(values))
    span = hi - lo
    top = levels - 1
    out = [[top // 2 if span == 0 else min(top, int((v - lo) / span * levels)) for v in row] for row in matrix]
    return out, lo, hi


# -------------------------------------------------------------------------------------------------- report


@dataclass
class RunProfile:
    spec: RunSpec
    budget: int | None  # resolved per-head budget (None: whole prompt)
    answer: str
    prompt_len: int
    stats: RunStats
    evicted: bool  # False when nothing was dropped (full/none, or a budget >= the prompt)
    layer_budgets: list[int] | None
    head_budgets: list[list[int]] | None  # layers x heads
    preference: list[list[float]] | None  # layers x heads
    importance: list[float] | None
    importance_source: str | None  # "profile" (calibration file), "online" (this input) or None
    pages: PageMap | None
    pages_note: str | None = None  # why there is no page map
    dropped_tokens: int = 0
    rope_factor: int = 1
    notes: list[str] = field(default_factory=list)
    residual: list[list[int]] | None = None  # layers x heads: 1 = the head holds a residual entry
    # the model's index of each row of the per-layer lists (DiffusionGemma: its full-attention layers only)
    layers: list[int] | None = None
    # what ``pipeline.answer_row`` says of the answer: its claim, confidence, what was read (by page) and where from
    row: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        pages: dict[str, Any] = (self.pages.as_dict() if self.pages is not None
                                 else {"mapped": False, "note": self.pages_note})
        return {
            "policy": self.spec.policy, "budget": self.budget, "ratio": self.spec.ratio, "label": self.spec.label,
            "evicted": self.evicted, "answer": self.answer, "prompt_tokens": self.prompt_len,
            "dropped_tokens": self.dropped_tokens, "rope_factor": self.rope_factor, "stats": self.stats.as_dict(),
            "layer_budgets": self.layer_budgets, "head_budgets": self.head_budgets, "preference": self.preference,
            "importance": self.importance, "importance_source": self.importance_source, "pages": pages,
            "residual_heads": self.residual, "claim": self.row.get("claim"),
            "confidence": self.row.get("confidence"), "read": self.row.get("read"),
            # which layers the rows are, where they are not every layer from 0 (DiffusionGemma's full layers)
            **({} if self.layers is None or self.layers == list(range(len(self.layers))) else
               {"layers": self.layers}),
        }

    def layer_labels(self, rows: int) -> list[int]:
        """The model's layer index of each of ``rows`` rows (0 .. rows - 1 where the run did not say)."""
        return self.layers if self.layers is not None and len(self.layers) == rows else list(range(rows))


@dataclass
class ProfileReport:
    document: dict[str, Any]
    model: str
    question: str
    device: str
    runs: list[RunProfile]
    focus: int | None  # the run drawn as pictures (the first that evicts, or the chosen one)
    memory_note: str
    notes: list[str] = field(default_factory=list)
    heads: str = "heads"  # what a heatmap column is: "heads", or "KV heads" for a GQA model
    warmup_s: float | None = None  # the warm-up run (the first run on this prompt, outside the measurements)
    load_s: float | None = None  # loading the model (the command sets it)

    @property
    def focus_run(self) -> RunProfile | None:
        return None if self.focus is None else self.runs[self.focus]

    def as_dict(self) -> dict[str, Any]:
        return {"document": self.document, "model": self.model, "question": self.question, "device": self.device,
                "memory_note": self.memory_note, "focus": self.focus, "heads": self.heads,
                "warmup_s": self.warmup_s, "load_s": self.load_s, "runs": [r.as_dict() for r in self.runs]}


def memory_note(device: torch.device) -> str:
    if device.type == "cuda":
        return "peak memory: CUDA allocator peak of each run (peak statistics reset before each run)"
    return ("peak memory: the process's peak RSS, cumulative over the runs in this process (a later run never "
            "shows less than an earlier one)")


def _fresh_peak(device: torch.device) -> None:
    free_unreachable()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _importance(plan: CachePlan | None, records: Sequence[LayerRecord]) -> tuple[list[float] | None, str | None]:
    """The I(l) the run's layer budgets came from, as its cache plan recorded it: measured online, or the
    calibration profile, or none (uniform layer budgets)."""
    ordered = sorted(records, key=lambda r: r.layer)
    if ordered and all(r.importance is not None for r in ordered):
        return [float(r.importance) for r in ordered], "online"  # type: ignore[arg-type]
    if plan is None or plan.importance_source != "profile" or plan.importance is None:
        return None, None
    return [float(x) for x in plan.importance], "profile"


def profile_document(
    session: Any,
    doc: Document,
    question: str,
    gen: Any,
    specs: Sequence[RunSpec],
    *,
    long: str = "truncate",
    layer_budgets: str = "auto",
    seed: int = 0,
    focus: int | None = None,
    warmup: bool = True,
    on_run: Callable[[int, int, RunSpec], None] | None = None,
    on_event: Callable[[Any], None] | None = None,
    on_prompt: Callable[[Any], None] | None = None,
    on_answer: Callable[[Any], None] | None = None,
) -> ProfileReport:
    """Run every spec on the same input, one after another, and collect a ``ProfileReport``.

    Each run is ``pipeline.ask`` (``long`` says how a document longer than the window is fitted); ``on_event``
    and ``on_prompt`` go to it, ``on_answer`` sees each run's answer.
    ``warmup`` first runs the first spec once on this prompt, outside the measurements, so that no row pays the
    one-time costs of a first run (thread pools, the allocator growing, kernels chosen for these shapes); its time
    is the report's ``warmup_s``. ``focus`` picks the run drawn as pictures; by default the first that evicts.
    """
    import time

    from maskkv_cli.app.pipeline import answer_row, ask
    from maskkv_cli.app.run_settings import ONE_PROMPT, PROFILES_ONE_PROMPT, RunSettings, check_long_family
    from maskkv_cli.models.catalog import is_embedded_model

    if not specs:
        raise UsageError("no run to profile")

    def config(spec: RunSpec) -> Any:
        return RunSettings(policy=spec.policy, budget=spec.budget, ratio=spec.ratio, seed=seed,
                           layer_budgets=layer_budgets).cache()

    check_long_family(long, session.model.config.family, ONE_PROMPT, PROFILES_ONE_PROMPT)
    warmup_s = None
    if warmup:
        started = time.perf_counter()
        ask(session, doc.text, question, gen, config(specs[0]), long=long)
        warmup_s = time.perf_counter() - started
    embedded = is_embedded_model(str(session.model_path))
    spans = doc.page_spans()
    runs: list[RunProfile] = []
    for i, spec in enumerate(specs):
        if on_run is not None:
            on_run(i, len(specs), spec)
        _fresh_peak(session.device)
        cache = config(spec)
        answer = ask(session, doc.text, question, gen, cache, long=long, on_event=on_event, on_prompt=on_prompt)
        if on_answer is not None:
            on_answer(answer)
        fitted = answer.fitted
        result = answer.result
        records: list[LayerRecord] = sorted(result.records, key=lambda r: r.layer)
        mapped = map_pages(session.tokenizer, doc, fitted.text, question, records, answer.prompt_len, fitted.dropped)
        importance, source = (None, None)
        if result.layer_budgets is not None:  # only an evicting run has layer budgets that came from I(l)
            importance, source = _importance(result.plan, records)
        budgets = result.layer_budgets or ([r.layer_budget for r in records] if records else None)
        notes = [n for n in [fitted.rule, *answer.notes] if n]
        runs.append(RunProfile(
            spec=spec, budget=answer.budget, answer=answer.text, prompt_len=answer.prompt_len, stats=result.stats,
            evicted=result.layer_budgets is not None, layer_budgets=list(budgets) if budgets else None,
            head_budgets=head_budget_matrix(records) if records else None,
            preference=preference_matrix(records), importance=importance, importance_source=source,
            pages=mapped if isinstance(mapped, PageMap) else None,
            pages_note=mapped if isinstance(mapped, str) else None,
            dropped_tokens=fitted.dropped, rope_factor=fitted.rope_factor, notes=notes,
            residual=residual_matrix(records) if records else None,
            row=answer_row(answer, embedded, question, spans), layers=[r.layer for r in records] or None,
        ))
    if focus is None:
        focus = next((i for i, r in enumerate(runs) if r.evicted), None)
    document = {"source": doc.source, "sha256": doc.sha256, "pages": len(doc.pages), "chars": doc.n_chars}
    report_notes = list(dict.fromkeys(n for r in runs for n in r.notes))
    cfg = session.model.config
    evicted = cfg.evicted_layers  # the layers a policy cuts and the heatmap draws
    own = cfg.family_config  # DiffusionGemma's per-layer config: its full layers' KV heads, not the sliding ones'
    kv_heads = own.layer(evicted[0]).n_kv_heads if own is not None and evicted else cfg.n_kv_heads
    group = cfg.n_heads // kv_heads
    heads = "heads" if group == 1 else "KV heads"
    if group > 1:
        report_notes.append(f"GQA model: the cache and the heatmap are per key/value head ({kv_heads} KV heads, "
                            f"{group} query heads each; votes averaged over each group)")
    if len(evicted) < cfg.n_layers:
        report_notes.append(f"only the layers whose cache grows with the prompt are cut and drawn (layers "
                            f"{', '.join(str(i) for i in evicted)}); the others hold at most their window and stay "
                            "exact")
    return ProfileReport(document, str(session.model_path), question, str(session.device), runs, focus,
                         memory_note(session.device), report_notes, heads, warmup_s)
