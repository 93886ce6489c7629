"""What every benchmark case shares: the model it runs (random weights of a named shape, or a checkpoint), random
prompt ids, and running a case in a fresh process (``python -m <module> --case JSON`` prints one JSON row) so
that its peak memory is its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from maskkv_cli.errors import MaskKVError
from maskkv_cli.models.config import ModelConfig, named_config
from maskkv_cli.models.families import build_model
from maskkv_cli.models.meta import meta_device
from maskkv_cli.models.protocol import DiffusionLM

__all__ = ["BenchError", "case_main", "failure_cause", "load_bench_model", "random_model", "random_prompt",
           "run_in_fresh_process", "weights_bytes"]


class BenchError(MaskKVError):
    """A benchmark case that failed (its process crashed, ran out of memory, ran past its timeout, or printed no
    row). The message is one line; ``tail``: the last lines of the child's stderr; ``log``: the file holding all
    of it (None when it was not kept)."""

    def __init__(self, message: str, tail: Sequence[str] = (), log: Path | None = None) -> None:
        super().__init__(message)
        self.tail = list(tail)
        self.log = log


def random_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, std: float = 0.02) -> DiffusionLM:
    """Random normal weights of the shape ``cfg``, allocated directly on the device in ``dtype``.

    Built on the meta device and filled in place, so loading never holds a float32 copy or a second buffer
    (the point for an 8B shape on a GPU, and for clean memory readings). Weights do not change speed.
    """
    dev = torch.device(device)
    with meta_device():
        model = build_model(cfg)
    model = model.to(dtype=dtype).to_empty(device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    model.requires_grad_(False)
    return model.eval()


def load_bench_model(config: str | None, model_path: str | None, device: torch.device, dtype: str,
                     seed: int, quantize: str = "none") -> DiffusionLM:
    """A checkpoint (its linear layers quantized as they are read), or random weights of the shape ``config``
    (quantized once built: ``quantize_model``); ``quantize``: none, int8 or int4."""
    from maskkv_cli.models.loading import load_model, parse_dtype
    from maskkv_cli.models.quantize import quantize_model

    if model_path:
        return load_model(model_path, device=device, dtype=None if dtype == "auto" else dtype, quantize=quantize)
    model = random_model(named_config(config or "llada-small"), device, parse_dtype(dtype, device, quantize), seed)
    return quantize_model(model, quantize)  # type: ignore[return-value]


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters as held (a quantized one by its packed values, scales and zero points)."""
    from maskkv_cli.models.quantize import tensor_bytes

    return sum(tensor_bytes(p) for p in model.parameters())


class _PrefillDone(Exception):
    """Raised from a generation's progress callback to stop it right after its prefill."""


def run_to_prefill(run: Callable[[Callable[[Any], None]], Any]) -> None:
    """``run(on_event)`` (a generation given its progress callback), stopped right after its ``prefill`` event: a
    warm-up at a case's own length."""

    def stop_after_prefill(event: Any) -> None:
        if event.kind == "prefill":
            raise _PrefillDone

    try:
        run(stop_after_prefill)
    except _PrefillDone:
        pass


def random_prompt(cfg: ModelConfig, length: int, seed: int, device: torch.device, batch: int = 1) -> torch.Tensor:
    """Random token ids (never the mask token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
    ids[ids == cfg.mask_token_id] = (cfg.mask_token_id + 1) % cfg.vocab_size
    return ids.to(device)


TAIL_LINES = 30  # stderr lines a failed case keeps: CUDA errors end with generic hint lines below the cause
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")


def failure_cause(lines: Sequence[str]) -> str:
    """The line of a child's stderr that names its failure: the last line that starts a Python exception
    (``RuntimeError: CUDA error: ...``), not the hints printed below it, else the last non-empty line."""
    text = [ln.strip() for ln in lines if ln.strip()]
    for line in reversed(text):
        if _EXCEPTION_LINE.match(line):
            return line
    return text[-1] if text else "no output"


def run_in_fresh_process(module: str, case_json: str, threads: int, label: str,
                         timeout: float | None = None, log: Path | None = None) -> dict[str, Any]:
    """Run ``python -m module --case JSON`` in a fresh process with ``threads`` threads; return its JSON row.

    The child's stderr goes to the file ``log`` (kept; a temporary file when None), so that a failure's cause is
    on disk even when the child is killed. A child running past ``timeout`` seconds is killed, so it does not keep
    the device. A failure raises ``BenchError`` whose message is one line (the cause) and whose ``tail`` holds the
    last ``TAIL_LINES`` lines of stderr."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", module, "--case", case_json]
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with (open(log, "w+", encoding="utf-8") if log is not None
          else tempfile.TemporaryFile("w+", encoding="utf-8")) as err:
        # the child stays in this process group, so that whatever stops this run as a group stops it too
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        timed_out = False
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stdout = _kill(proc)
        except BaseException:  # Ctrl-C or any error here: the child must not go on holding the device
            _kill(proc)
            raise
        err.seek(0)
        stderr_lines = err.read().rstrip().splitlines()  # blank lines at the end would take the tail's room
    tail = stderr_lines[-TAIL_LINES:]
    where = f"; stderr in {log}" if log is not None else ""
    if timed_out:
        raise BenchError(f"{label} timed out after {timeout:g} s and was killed{where}", tail, log)
    lines = [ln for ln in stdout.splitlines() if ln.strip().startswith("{")]
    row = json.loads(lines[-1]) if lines else None
    if row is not None and row.get("error"):  # the case's own one-line error (a usage error in the case)
        raise BenchError(f"{label} failed: {row['error']}", tail, log)
    if proc.returncode != 0 or row is None:
        why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit code {proc.returncode}"
        raise BenchError(f"{label} failed ({why}): {failure_cause(stderr_lines)}{where}", tail, log)
    return row


def _kill(proc: subprocess.Popen[str]) -> str:
    """SIGKILL the child and return what it had printed; a helper process it started that still holds its stdout
    open is not waited for beyond a few seconds."""
    proc.kill()
    try:
        return proc.communicate(timeout=5)[0] or ""
    except subprocess.TimeoutExpired:
        if proc.stdout is not None:
            proc.stdout.close()
        proc.wait()
        return ""


def case_main(argv: Sequence[str] | None, prog: str, run: Callable[[str], dict[str, Any]]) -> int:
    """Child-process entry point shared by the benchmarks: ``--case JSON`` in, one JSON row (or error) out."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description="Run one case and print its JSON row.")
    parser.add_argument("--case", required=True, help="the case as JSON")
    args = parser.parse_args(argv)
    try:
        row = run(args.case)
    except MaskKVError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    print(json.dumps(row), flush=True)
    return 0
