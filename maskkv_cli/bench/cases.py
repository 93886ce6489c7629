"""What every benchmark case shares: the model it runs (random weights of a named shape, or a checkpoint), random
prompt ids, and running a case in a fresh process (``python -m <module> --case JSON`` prints one JSON row) so
that its peak memory is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from maskkv_cli.errors import MaskKVError
from maskkv_cli.models.config import ModelConfig, named_config
from maskkv_cli.models.families import build_model
from maskkv_cli.models.protocol import DiffusionLM

__all__ = ["BenchError", "case_main", "load_bench_model", "random_model", "random_prompt", "run_in_fresh_process",
           "weights_bytes"]


class BenchError(MaskKVError):
    """A benchmark case that failed (its process crashed, ran out of memory, or printed no row)."""


def random_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, std: float = 0.02) -> DiffusionLM:
    """Random normal weights of the shape ``cfg``, allocated directly on the device in ``dtype``.

    Built on the meta device and filled in place, so loading never holds a float32 copy or a second buffer
    (the point for an 8B shape on a GPU, and for clean memory readings). Weights do not change speed.
    """
    dev = torch.device(device)
    with torch.device("meta"):
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


def random_prompt(cfg: ModelConfig, length: int, seed: int, device: torch.device, batch: int = 1) -> torch.Tensor:
    """Random token ids (never the mask token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
    ids[ids == cfg.mask_token_id] = (cfg.mask_token_id + 1) % cfg.vocab_size
    return ids.to(device)


def run_in_fresh_process(module: str, case_json: str, threads: int, label: str,
                         timeout: float | None = None) -> dict[str, Any]:
    """Run ``python -m module --case JSON`` in a fresh process with ``threads`` threads; return its JSON row."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", module, "--case", case_json]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{label} ran past {timeout:.0f} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("{")]
    if lines and json.loads(lines[-1]).get("error"):  # the case's own one-line error (a usage error in the case)
        raise BenchError(f"{label} failed: {json.loads(lines[-1])['error']}")
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit code {proc.returncode}"
        raise BenchError(f"{label} failed ({why}): {tail}")
    row = json.loads(lines[-1])
    if row.get("error"):
        raise BenchError(f"{label} failed: {row['error']}")
    return row


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
