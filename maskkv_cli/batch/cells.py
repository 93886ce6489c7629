"""``bench quality`` on a pool: its rows' cells (one (task, length) x (policy, budget) each) run on worker
processes or Ray actors like batch jobs, and come back to the driver, which scores them and writes the same
resumable results folder (row keys unchanged)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from maskkv_cli.app.session import Session
from maskkv_cli.batch.dispatch import Pool, results
from maskkv_cli.errors import MaskKVError
from maskkv_cli.models.checkpoint import ModelFolder
from maskkv_cli.tasks.cells import CellAnswer, CellRunner, QualityCell


class PlanningSession(Session):
    """The driver's stand-in for a session when the model runs elsewhere: tokenizer, config and the workers'
    precision and quantization (which enter the row keys), and no weights, so planning an 8B run does not load it
    here."""

    def __init__(self, model_path: str | ModelFolder, dtype: str | None, device_kind: str,
                 quantize: str = "none") -> None:  # no super()
        from maskkv_cli.models.loading import parse_dtype

        folder = ModelFolder.of(model_path)
        self.model = SimpleNamespace(config=folder.config,  # type: ignore[assignment]
                                     dtype=parse_dtype(dtype, device_kind, quantize),
                                     quantization=quantize)
        self.init_text_side(folder)

    def answer_ids(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a planning session has no weights; the workers answer")


@dataclass(frozen=True)
class CellJob:
    """A cell in the shape ``dispatch`` runs: a key, no document, a message for the worker."""

    cell: QualityCell
    document_sha: str = ""

    @property
    def key(self) -> str:
        return self.cell.key

    def message(self) -> dict[str, Any]:
        return {"key": self.cell.key, "kind": "cell", "prompts": self.cell.prompts, "gen": self.cell.gen,
                "cache": self.cell.cache, "batch_size": self.cell.batch_size}


def pooled_cells(pool: Pool) -> CellRunner:
    """A ``run_quality`` cell runner over ``pool`` (closed when the run ends); a cell that fails stops the run
    (its row would be wrong), after the rows finished so far are saved."""

    def run(cells: list[QualityCell]) -> Iterator[tuple[QualityCell, list[CellAnswer]]]:
        try:
            if not cells:
                return
            for job, fields, _ in results([CellJob(c) for c in cells], pool, {"": ""}):  # type: ignore[misc]
                if fields.get("error"):
                    cache = job.cell.cache  # type: ignore[attr-defined]
                    raise MaskKVError(f"a bench quality cell ({cache.policy}, budget {cache.budget}) failed: "
                                      f"{fields['error']}")
                yield job.cell, fields["answers"]  # type: ignore[attr-defined]
        finally:
            pool.close()

    return run
