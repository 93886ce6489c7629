"""Memory readings: live tensor bytes (``live_bytes.py``) and the per-generation CUDA peak (``stats.py``)."""

from __future__ import annotations

import torch

from maskkv_cli.bench.live_bytes import LiveBytes
from maskkv_cli.runtime import stats

MIB = 1 << 20


def test_live_bytes_counts_new_storages_once_and_frees_them():
    weights = torch.randn(256, 256)  # created before the mode: never counted
    with torch.no_grad(), LiveBytes() as live:
        a = torch.empty(MIB // 4)  # 1 MiB
        assert live.live == MIB
        views = (a.view(2, -1), a[:10], weights.t(), weights[:3])  # views share storages: nothing new
        assert live.live == MIB
        b = a * 2  # a new 1 MiB
        b.add_(1)  # in place: nothing new
        assert live.live == 2 * MIB and live.count == 2
        del a, views
        assert live.live == MIB  # a's storage is gone once its last view is
        del b
        c = torch.nn.functional.linear(torch.randn(64, 256), weights)  # input (64 KiB) freed, output kept
        assert live.live == c.numel() * 4
    assert live.peak == 2 * MIB


def test_live_bytes_window_peaks():
    with torch.no_grad(), LiveBytes() as live:
        a = torch.empty(MIB // 4)
        del a
        assert live.take_window_peak() == MIB
        keep = torch.empty(MIB // 8)
        assert live.take_window_peak() == MIB // 2  # the new window starts at the level then (0), rises to 512 KiB
        assert live.take_window_peak() == MIB // 2 and keep.numel()


def test_cuda_peak_is_reset_and_summed_over_devices(monkeypatch):
    reset, allocated = [], {"cuda:0": (10, 30), "cuda:1": (5, 7)}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: reset.append(str(d)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: allocated[str(d)][0])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: allocated[str(d)][1])
    devices = [torch.device("cuda:0"), torch.device("cuda:0"), torch.device("cuda:1")]
    stats.reset_cuda_peaks(devices + [torch.device("cpu")])
    assert reset == ["cuda:0", "cuda:1"]
    assert stats.memory_now(devices) == (15, 37, "cuda")
    assert stats.peak_memory(devices) == (37, "cuda")  # the peak alone, as memory_now gives it
    assert stats.memory_now("cpu")[2] == "rss" and stats.peak_memory("cpu")[1] == "rss"


def test_run_stats_as_dict_is_asdicts_with_the_derived_figures():
    from dataclasses import asdict

    run = stats.RunStats("maskkv", 12, 8, steps_run=3, prefill_s=0.5, step_s=[0.1, 0.3, 0.2], total_s=1.1)
    d = run.as_dict()
    assert d == {**asdict(run), "median_step_s": 0.2, "tokens_per_s": 8 / 1.1, "compression": 1.0}
    assert d["step_s"] is not run.step_s  # a copy: the row does not change with the stats


def test_generation_resets_the_cuda_peak(tiny_model, monkeypatch):
    from prompts import random_ids

    from maskkv_cli.policies import get_policy
    from maskkv_cli.sampling.llada import GenerationConfig, generate

    seen = []
    monkeypatch.setattr("maskkv_cli.sampling.common.reset_cuda_peaks", lambda devices: seen.append(list(devices)))
    generate(tiny_model, random_ids(tiny_model, 16), GenerationConfig(gen_length=8, steps=4, block_length=8),
             get_policy("full"))
    generate(tiny_model, random_ids(tiny_model, 16), GenerationConfig(gen_length=8, steps=4, block_length=8),
             get_policy("full"))
    assert seen == [[tiny_model.device], [tiny_model.device]]  # once at the start of every generation


def test_one_peak_reading_reads_the_peak_once_per_block_and_thread(monkeypatch):
    import threading

    reads = []
    monkeypatch.setattr(stats, "peak_rss_bytes", lambda: reads.append(1) or 100 * len(reads))
    assert stats.peak_memory("cpu") == (100, "rss") and stats.peak_memory("cpu") == (200, "rss")  # each call reads
    with stats.one_peak_reading():
        first = stats.peak_memory([torch.device("cpu")])
        with stats.one_peak_reading():  # nested: the outer block's reading
            assert stats.peak_memory([torch.device("cpu")]) == first == (300, "rss")
        other: list[tuple[int, str]] = []
        thread = threading.Thread(target=lambda: other.append(stats.peak_memory([torch.device("cpu")])))
        thread.start()
        thread.join()
        assert other == [(400, "rss")]  # another thread reads for itself
        assert stats.peak_memory("cpu") == (500, "rss")  # another device key: its own reading, kept too
        assert stats.peak_memory("cpu") == (500, "rss")
    assert stats.peak_memory([torch.device("cpu")]) == (600, "rss")  # after the block: read again


def test_generations_in_a_batch_share_the_cuda_peak(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each generation restarts the CUDA peak, except inside a batch (``shared_cuda_peak``): there it restarts once
    at the start and where the batch restarts it (none running), so a generation joining later does not wipe out
    the peak of those already running. Counted on a stand-in for CUDA's reset."""
    resets: list[str] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: resets.append(str(d)))
    cuda, cpu = [torch.device("cuda", 0)], [torch.device("cpu")]
    stats.reset_cuda_peaks(cuda)
    stats.reset_cuda_peaks(cpu)  # the CPU's figure is the process's: nothing to restart
    assert resets == ["cuda:0"]
    with stats.shared_cuda_peak(cuda):
        assert resets == ["cuda:0"] * 2
        stats.reset_cuda_peaks(cuda)  # a generation joining the batch
        with stats.shared_cuda_peak(cuda):  # nested: the outer batch's
            stats.reset_cuda_peaks(cuda)
        assert resets == ["cuda:0"] * 2
        stats.reset_cuda_peaks(cuda, shared=True)  # the batch's own restart, none running
        assert resets == ["cuda:0"] * 3
    stats.reset_cuda_peaks(cuda)  # after the batch: each generation its own again
    assert resets == ["cuda:0"] * 4


def test_phase_peaks_on_cuda_are_the_allocators_own(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On CUDA each phase's peak is the allocator's peak between its marks (read, then restarted), not a sample:
    a peak shorter than the sampling interval is not missed. Counted on stand-ins for CUDA's two calls."""
    from maskkv_cli.bench.memory import PhasePeaks

    allocated = {"peak": 100}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: allocated.update(peak=100))
    prof = PhasePeaks(None, torch.device("cuda", 0))
    assert prof.exact
    prof.mark("k projection + RoPE", 0)
    allocated["peak"] = 900  # a brief peak inside the phase, gone before its end
    prof.mark("attention (SDPA)")
    allocated["peak"] = 300
    prof.mark("MLP")
    assert prof.peaks[(0, "k projection + RoPE")] == 900 and prof.peaks[(0, "attention (SDPA)")] == 300
    assert prof.peaks[(0, "MLP")] == 100 and prof.highest == 900
    assert [row["peak_above_weights_bytes"] for row in prof.phases(100)][1:] == [800, 200, 0]
