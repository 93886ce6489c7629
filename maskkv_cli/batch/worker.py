"""A worker: one loaded model answering job messages; any failure of a job becomes a one-line error in its row."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from maskkv_cli.batch.answering import answer_job, answer_jobs, open_session
from maskkv_cli.batch.jobs import AnswerSettings
from maskkv_cli.errors import MaskKVError


@dataclass(frozen=True)
class WorkerSpec:
    """How to start a worker: the model, where and in which precision, and how many CPU threads it may use."""

    model_path: str
    device: str = "cpu"
    dtype: str | None = None
    quantize: str = "none"  # the weights' quantization (none, int8, int4), the same in every worker
    threads: int | None = None  # torch intra-op threads; None leaves torch's default


def one_line_error(exc: BaseException) -> str:
    """The first line of an error, with out-of-memory errors named as such."""
    if type(exc).__name__ == "OutOfMemoryError":
        return "the device ran out of memory (try a smaller budget, a shorter document or a bigger device)"
    if isinstance(exc, MaskKVError):
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class Worker:
    """Loads the model once (at construction) and answers job messages from any runner."""

    def __init__(self, spec: WorkerSpec, name: str = "main") -> None:
        if spec.threads:
            import torch

            torch.set_num_threads(spec.threads)
        self.session = open_session(spec.model_path, spec.device, spec.dtype, spec.quantize)
        self.name = name

    def run(self, message: dict[str, Any], text: Any) -> dict[str, Any]:
        """The answering part of a job's row; ``error`` holds a one-line reason when it failed.

        A message of kind "cell" is a ``bench quality`` row's prompts; its answers come back under "answers". A
        message of kind "group" is several jobs answered together (``text``: their documents by hash); each job's
        fields come back under "group", in order.
        """
        started = time.perf_counter()
        try:
            if message.get("kind") == "group":
                fields = {"group": [{**row, "error": None, "key": m["key"]}
                                    for row, m in zip(answer_jobs(self.session, text, message["jobs"],
                                                                  message["batch_size"]), message["jobs"],
                                                      strict=True)]}
            elif message.get("kind") == "cell":
                from maskkv_cli.tasks.cells import answer_prompts

                fields = {"answers": answer_prompts(self.session, message["prompts"], message["gen"], message["cache"],
                                                    message.get("batch_size", 1))}
            else:
                fields = answer_job(self.session, text, message["question"], AnswerSettings(**message["settings"]))
            fields["error"] = None
        except Exception as exc:  # one job's failure (OOM, a bad setting) must not stop the run
            fields = {"answer": None, "error": one_line_error(exc)}
        if fields["error"] is not None:  # here, where the error is no longer named (see free_failed_job)
            free_failed_job()
        fields.update(key=message["key"], worker=f"{self.name}@{os.uname().nodename}",
                      seconds=round(time.perf_counter() - started, 4))
        return fields


def free_failed_job() -> None:
    """Free what a failed job held before the next one runs: its error's traceback and the generation form a cycle
    (``runtime.stats.free_unreachable``), so an out-of-memory job would otherwise leave its memory taken from the next
    jobs until the cycle collector's next full run. Called once the error is no longer named by the caller."""
    from maskkv_cli.runtime.stats import free_unreachable

    try:
        free_unreachable()
    except Exception:  # freeing memory is best effort: a job's row must not fail here
        pass
