"""``maskkv bench loading``: the peak memory of loading a checkpoint, unquantized and with int8 / int4 weights.

Issue 48's target: quantizing while loading, shard by shard, the full-precision model is never resident, so the
loading peak stays within **the loaded weights + one shard**. Each setting loads the checkpoint in a fresh process
(``python -m maskkv_cli.bench.loading --case JSON`` prints one JSON row), so that nothing loaded before counts.

The reading is what the OS sees. On the CPU: the resident set just before ``load_model`` (torch, safetensors and
torchao already imported, so their code is not counted), and the kernel's peak resident set (VmHWM, reset with
``/proc/self/clear_refs`` at that moment) when it returns: ``peak above start`` is every byte the load made
resident at its worst moment: the tensors kept, the shard's pages mapped from the file while it is read, the
transient full-precision copy of the layer being quantized and torchao's working buffers, and whatever the C
allocator kept of freed memory. The loaded weights are ``quantize.weights_bytes`` of the model (its parameters
and buffers as held, quantized ones by their packed values, scales and zero points); one shard is the largest
safetensors file's size. On CUDA the same figures come from the allocator (``memory_allocated`` before,
``max_memory_allocated`` after a reset) and the shard's pages are not on the device.

With ``--config`` the checkpoint is random weights of a named shape written in bf16 to a temporary folder in
shards of ``--shard-mb`` MiB (removed after the run); ``--model`` loads a checkpoint folder as it is.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from maskkv_cli.bench.cases import case_main, random_model, run_in_fresh_process
from maskkv_cli.bench.results import JsonCase, ResultsFolder, mib, settings_key
from maskkv_cli.errors import UsageError
from maskkv_cli.models.meta import meta_device

MIB = 1 << 20
# What a load may hold above the weights and one shard and still meet the target: Python's objects for the modules
# and torchao's tensor wrappers, and the small blocks the C allocator keeps (measured 1-3 MiB on a 56 MiB LLaDA2
# MoE shape, 8-10 MiB on llada2-small's 1.4 GiB in bf16).
SLACK = 16 * MIB


@dataclass(frozen=True)
class LoadCase(JsonCase):
    """One load: a checkpoint folder, its weights' quantization, the dtype and device it is loaded in; ``source``
    names the checkpoint in the row's key (a random one's folder is temporary, its shape and shards are not)."""

    model: str
    quantize: str = "none"
    dtype: str = "auto"
    device: str = "cpu"
    threads: int = 1
    source: str = ""

    def key(self) -> str:
        settings = asdict(self)
        if self.source:
            del settings["model"]
        return settings_key(settings)

    @property
    def method(self) -> str:
        return self.quantize


def shard_sizes(folder: Path) -> list[int]:
    """Bytes of each safetensors file of the checkpoint in ``folder``."""
    from maskkv_cli.models.loading import weight_files

    return sorted((f.stat().st_size for f in set(weight_files(folder).values())), reverse=True)


def _warm(folder: Path, mode: str, device: torch.device, dtype: str) -> None:
    """Run once what loading runs besides reading weights, so that what it sets up once per process is not
    counted as the load's: the modules imported on first use (about 70 MiB of code and tables when the family's
    shapes are first built, measured on llada2-small), torchao's first quantization, and the row floor's probe of
    the dtype's matrix products (``rows.prepare``: up to 80 MiB of the BLAS library's buffers in bf16)."""
    from maskkv_cli.models.families import build_model, parameter_shapes
    from maskkv_cli.models.loading import parse_dtype, read_config
    from maskkv_cli.models.quantize import check_mode, quantize_weight_of
    from maskkv_cli.models.rows import Linear, small_rows

    cfg = read_config(folder)
    parameter_shapes(cfg)
    with meta_device():
        build_model(cfg)
    dt = parse_dtype(None if dtype == "auto" else dtype, device, mode)
    small_rows(device, dt)
    if check_mode(mode) is not None:
        quantize_weight_of(Linear(128, 32, bias=False, device=device, dtype=dt), mode)


def run_load_case(case: LoadCase) -> dict[str, Any]:
    """Load ``case.model`` in this process and return its memory row (see the module doc)."""
    from maskkv_cli.models.loading import load_model
    from maskkv_cli.models.quantize import quantized_layers, weights_bytes
    from maskkv_cli.runtime.stats import read_current, read_peak, reset_peak, settle_memory

    torch.set_num_threads(case.threads)
    dev = torch.device(case.device)
    folder = Path(case.model)
    shards = shard_sizes(folder)
    _warm(folder, case.quantize, dev, case.dtype)
    settle_memory(dev)  # collects the warm-up's cycles too
    start = read_current(dev)
    peak_reset = reset_peak(dev)
    t0 = time.perf_counter()
    model = load_model(folder, device=dev, dtype=None if case.dtype == "auto" else case.dtype,
                       quantize=case.quantize)
    seconds = time.perf_counter() - t0
    peak = read_peak(dev)
    after = read_current(dev)
    weights = weights_bytes(model)
    target = weights + shards[0]
    done, kept = quantized_layers(model)
    return {
        "key": case.key(), "method": case.method, **asdict(case),
        "dtype_loaded": str(model.dtype).removeprefix("torch."),
        "mem_kind": "cuda" if dev.type == "cuda" else "rss",
        "peak_reset": peak_reset,
        "start_bytes": start,
        "peak_bytes": peak,
        "after_bytes": after,
        "peak_above_start_bytes": peak - start,
        "after_above_start_bytes": after - start,
        "weights_bytes": weights,
        "shards": len(shards),
        "largest_shard_bytes": shards[0],
        "checkpoint_bytes": sum(shards),
        "target_bytes": target,
        "above_target_bytes": peak - start - target,
        "within_target": peak - start <= target + SLACK,
        # a tensor kept in the file's dtype on the CPU (unquantized loads) is a view of the file's pages, read when
        # first used: the load itself then makes little of it resident
        "mapped_from_file": dev.type == "cpu" and after - start < weights // 2,
        "quantized_layers": len(done),
        "unquantized_linear_layers": len(kept),
        "load_s": seconds,
    }


def run_load_subprocess(case: LoadCase, timeout: float | None = None) -> dict[str, Any]:
    return run_in_fresh_process("maskkv_cli.bench.loading", case.to_json(), case.threads,
                                f"loading {case.quantize}", timeout)


@dataclass(frozen=True)
class LoadSettings:
    """A ``bench loading`` run: a checkpoint folder (``model``) or a named shape written at random (``config``,
    bf16, in shards of ``shard_mb`` MiB), loaded once per quantization."""

    quantize: tuple[str, ...] = ("none", "int8", "int4")
    config: str | None = "llada2-small"
    model: str | None = None
    shard_mb: int = 256
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    threads: int = 1

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quantize"] = list(self.quantize)
        if self.model:
            d["config"] = d["shard_mb"] = d["seed"] = None
        return d

    def check(self) -> None:
        from maskkv_cli.defaults import check_quantize

        if not self.quantize or len(set(self.quantize)) < len(self.quantize):
            raise UsageError("--quantize must name distinct modes, e.g. none,int8,int4")
        for mode in self.quantize:
            check_quantize(mode)
        if self.shard_mb < 1:
            raise UsageError("--shard-mb must be at least 1")
        if self.threads < 1:
            raise UsageError("--threads must be at least 1")

    def cases(self, folder: Path) -> list[LoadCase]:
        from maskkv_cli.models.fingerprint import folder_fingerprint

        # a checkpoint is named by its files (a copy elsewhere keeps its rows, new files under one path do not)
        source = (f"checkpoint {folder_fingerprint(folder)}" if self.model else
                  f"{self.config} bf16, seed {self.seed}, shards of {self.shard_mb} MiB")
        return [LoadCase(str(folder), q, self.dtype, self.device, self.threads, source) for q in self.quantize]


@contextmanager
def checkpoint_folder(settings: LoadSettings) -> Iterator[Path]:
    """The folder the cases load: ``settings.model`` as it is, or random bf16 weights of ``settings.config`` written
    in shards to a temporary folder (removed afterwards)."""
    if settings.model:
        from maskkv_cli.paths import resolve_model_path

        yield resolve_model_path(settings.model)
        return
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.loading import save_model

    tmp = Path(tempfile.mkdtemp(prefix="maskkv-bench-loading-"))
    try:
        model = random_model(named_config(settings.config or "llada2-small"), dtype=torch.bfloat16, seed=settings.seed)
        folder = save_model(model, tmp / (settings.config or "model"), max_shard_bytes=settings.shard_mb * MIB)
        del model
        yield folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_loading(settings: LoadSettings, out: Path | None = None, fresh: bool = False, isolate: bool = True,
                on_case: Callable[[int, int, LoadCase, dict[str, Any] | None], None] | None = None,
                ) -> tuple[ResultsFolder, list[dict[str, Any]]]:
    """Every quantization's load in its fresh process (``isolate``), into a results folder that a rerun with the
    same settings reuses; the rows with the ratio of each peak to the unquantized one's."""
    settings.check()
    planned = [c.key() for c in settings.cases(Path(settings.model or ""))]  # a random checkpoint's: its shape
    results = ResultsFolder.open("loading", settings.as_dict(), planned, out, fresh)
    if any(results.get(key) is None for key in planned):  # a random checkpoint is written only when needed
        with checkpoint_folder(settings) as folder:
            results.run_cases(settings.cases(folder), run_load_subprocess if isolate else run_load_case, on_case)
    rows = results.ordered()
    plain = next((r for r in rows if r["quantize"] == "none" and not r.get("mapped_from_file")), None)
    for r in rows:  # (an unquantized load that maps the file has no peak of its own to compare with)
        r["peak_share_of_unquantized"] = (r["peak_above_start_bytes"] / plain["peak_above_start_bytes"]
                                          if plain and plain["peak_above_start_bytes"] > 0 else None)
    results.update(rows)
    results.write_text("summary.md", loading_markdown(settings, rows))
    return results, rows


def loading_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    kind = "CUDA" if any(r.get("mem_kind") == "cuda" for r in rows) else "RSS"
    head = ["weights", "dtype", "weights held", "largest shard", f"peak {kind} above start", "target (weights + shard)",
            "above target", "within", f"{kind} after load", "peak vs unquantized", "load s", "note"]
    body = [[r["quantize"], r["dtype_loaded"], mib(r["weights_bytes"]), mib(r["largest_shard_bytes"]),
             mib(r["peak_above_start_bytes"]), mib(r["target_bytes"]), mib(r["above_target_bytes"]),
             "yes" if r["within_target"] else "NO",
             mib(r["after_above_start_bytes"]),
             "-" if r.get("peak_share_of_unquantized") is None else f"{r['peak_share_of_unquantized']:.2f}x",
             f"{r['load_s']:.1f}", "weights mapped from the file (paged in when first used)"
             if r.get("mapped_from_file") else ""] for r in rows]
    return head, body


def loading_markdown(settings: LoadSettings, rows: Sequence[dict[str, Any]]) -> str:
    s = settings
    head, body = loading_table(rows)
    what = (f"checkpoint `{s.model}`" if s.model else
            f"random bf16 weights of the `{s.config}` shape in shards of {s.shard_mb} MiB")
    shards = rows[0]["shards"] if rows else 0
    lines = [
        "# maskkv bench loading",
        "",
        f"- {what} ({shards} shard(s)), loaded with dtype {s.dtype} on {s.device}, each setting in a fresh process",
        "- peak above start: the peak resident set (VmHWM, reset just before `load_model`) less the resident set "
        "then (CUDA: max_memory_allocated less memory_allocated); weights held: the model's tensors as held "
        f"(quantized ones packed); target: weights held + the largest shard file; within: at most {SLACK // MIB} MiB "
        "above it (Python's objects for the modules, the C allocator's small blocks)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    lines += ["| " + " | ".join(c) + " |" for c in body]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return case_main(argv, "maskkv_cli.bench.loading", lambda text: run_load_case(LoadCase.from_json(text)))


if __name__ == "__main__":
    raise SystemExit(main())
