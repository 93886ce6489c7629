"""Quantizing while loading (issue 48): a checkpoint in several shards loads within the quantized weights + its
largest shard, measured in a fresh process (``maskkv_cli.bench.loading``), and never holds the full-precision
model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")

from maskkv_cli.bench.cases import random_model  # noqa: E402
from maskkv_cli.bench.loading import SLACK, LoadCase, LoadSettings, run_load_subprocess, run_loading  # noqa: E402
from maskkv_cli.models.config import named_config  # noqa: E402
from maskkv_cli.models.loading import load_model, save_model  # noqa: E402

MIB = 1 << 20
# Each layer's full-precision copy is freed right after it is quantized; a quantized load maps every block of 128
# KiB or more (``runtime.allocator.small_blocks_mapped``), so those copies go back to the kernel even where the
# layers are as small as here (0.25-1 MiB) and would otherwise come from the heap (the start-up threshold is 4 MiB).
# What a load may hold above the weights and one shard is ``bench.loading.SLACK`` (measured 1.3-3.1 MiB here).


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LLaDA2 MoE shape of 56 MiB in fp32 (4 layers, 3 of 8 experts), saved in bf16 in 15 shards of at most
    2 MiB."""
    tiny = named_config("llada2-tiny")
    cfg = tiny.with_(d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, head_dim_override=64, mlp_hidden_size=512,
                     moe=dataclasses.replace(tiny.moe, n_experts=8, expert_hidden=256, shared_hidden=256,
                                             layers=(False,) + (True,) * 3))
    model = random_model(cfg, dtype=torch.bfloat16)
    return save_model(model, tmp_path_factory.mktemp("sharded") / "llada2-moe", max_shard_bytes=2 * MIB)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_load_stays_within_the_weights_and_one_shard(sharded: Path, mode: str) -> None:
    row = run_load_subprocess(LoadCase(str(sharded), mode))
    assert row["shards"] >= 8 and row["peak_reset"] and row["quantized_layers"] == 100
    assert row["peak_above_start_bytes"] <= row["weights_bytes"] + row["largest_shard_bytes"] + SLACK, row
    assert row["within_target"]
    # the bound means something here: the full-precision model alone is well above it
    full = load_model(sharded)
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    assert full_bytes > 1.5 * (row["weights_bytes"] + row["largest_shard_bytes"] + SLACK)
    assert row["after_above_start_bytes"] <= row["weights_bytes"] + SLACK  # nothing of the file stays mapped


def test_a_quantized_load_gives_the_model_quantized_in_memory(sharded: Path) -> None:
    """Quantizing as each layer is read (own copies, split layers) gives the same weights as quantizing the
    loaded model (in the dtype ``auto`` gives each: fp32 for int8, bf16 for int4 on the CPU)."""
    from maskkv_cli.models.quantize import quantize_model

    ids = torch.randint(6, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for mode, dtype in (("int8", "fp32"), ("int4", "bf16")):
            loaded = load_model(sharded, quantize=mode)
            assert loaded.dtype == load_model(sharded, dtype=dtype).dtype
            assert torch.equal(loaded(ids), quantize_model(load_model(sharded, dtype=dtype), mode)(ids))


def test_bench_loading_reuses_its_rows(sharded: Path, tmp_path: Path) -> None:
    settings = LoadSettings(quantize=("none", "int4"), config=None, model=str(sharded))
    folder, rows = run_loading(settings, out=tmp_path / "r")
    assert [r["quantize"] for r in rows] == ["none", "int4"] and rows[1]["peak_share_of_unquantized"] < 1
    assert (folder.path / "summary.md").read_text().count("\n| ") == 3  # the header and two rows
    calls: list[object] = []
    run_loading(settings, out=tmp_path / "r", on_case=lambda *a: calls.append(a[3]))
    assert all(row is not None and row["reused"] for row in calls)


def test_a_fresh_process_peak_reading_starts_at_its_reset_not_at_its_parent() -> None:
    """``stats.read_peak`` on the CPU is VmHWM, which ``reset_peak`` resets. ``getrusage``'s peak would not do: a
    process started by fork and exec keeps, as its peak, the resident set it had between the two, which is its
    parent's (here 256 MiB more than the child ever uses), so a fresh process's reading would start at its
    parent's size."""
    import subprocess
    import sys

    parent = torch.ones(256 * MIB // 4)  # touched: resident in this process when the child is forked
    code = ("from maskkv_cli.runtime.stats import read_peak, reset_peak, rss_bytes; "
            "print(int(reset_peak('cpu')), read_peak('cpu') - rss_bytes())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    del parent
    if out[0] != "1":
        pytest.skip("this kernel cannot reset the peak resident set")
    assert int(out[1]) < 16 * MIB
