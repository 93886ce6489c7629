"""``maskkv bench memory``: peak memory of a MaskKV prefill against the full cache's prefill.

Each prefill runs in a fresh process (``python -m maskkv_cli.bench.memory --case JSON`` prints one JSON row).
Two readings of the same prefill:

- **live tensor bytes** (``maskkv_cli.bench.live_bytes.LiveBytes``): the peak of the bytes of tensors allocated during
  the prefill and not yet freed, counted exactly as torch allocates and frees them. It does not depend on the C
  allocator or on what ran before, so repeat runs agree; the target and the share of full use it.
- **what the OS sees**: on the CPU the weights are the RSS right after loading; the peak is the kernel's peak
  resident set (VmHWM, reset with ``/proc/self/clear_refs`` after loading), so ``peak above weights = peak RSS -
  RSS after loading``. On CUDA the same figures come from the allocator (``max_memory_allocated``).

With ``profile`` on, hooks on the model and the engine label the phase that is running (projections, attention,
scoring, keeping K/V, attention output, MLP, LM head) per layer; each phase gets its exact live peak, and a
sampler thread reads the resident set every millisecond for the RSS per phase.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from maskkv_cli.bench.cases import case_main, load_bench_model, random_prompt, run_in_fresh_process, weights_bytes
from maskkv_cli.bench.live_bytes import LiveBytes
from maskkv_cli.bench.results import JsonCase, ResultsFolder, mib, settings_key
from maskkv_cli.errors import UsageError
from maskkv_cli.models.rows import small_rows
from maskkv_cli.runtime.stats import read_current, read_peak, reset_peak, settle_memory

TARGET_SHARE = 0.2  # MaskKV's live peak above weights should be at most this share of the full cache's
LIVE = "live_peak_above_weights_bytes"  # rows without it come from an older engine and are measured again


@dataclass(frozen=True)
class MemoryCase(JsonCase):
    policy: str
    budget: int | None
    prompt_len: int = 16384
    gen_length: int = 128
    block_length: int = 32
    config: str | None = "llada-small"
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    threads: int = 1
    profile: bool = True
    quantize: str = "none"  # the weights' quantization: none, int8, int4 (models/quantize.py)
    model_id: str | None = None  # ``model``'s files hashed (models.fingerprint): another checkpoint, another key

    def key(self) -> str:
        """The settings hashed (unquantized weights and a missing model id left out: such a case keeps the key it
        had before)."""
        settings = asdict(self)
        if self.quantize == "none":
            del settings["quantize"]
        if self.model_id is None:
            del settings["model_id"]
        return settings_key(settings)

    @property
    def method(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}@{self.budget}"


class PhasePeaks:
    """Peak memory per (layer, phase) of a prefill: hooks set the label; on the CPU a thread samples the resident
    set every ``interval_s``, on CUDA each phase's peak is the allocator's own (``max_memory_allocated`` at the
    phase's end, restarted at its start: exact, where sampling would miss a peak shorter than the interval).
    ``highest``: the largest of them (the allocator's peak over the whole prefill, on CUDA).

    The hooks wrap what the engine calls on every family's model (``models.protocol``: each block's ``keys``,
    ``values``, ``queries``, ``attn_proj`` and ``mlp``, the model's ``head``), never a family's own parameter
    names, so LLaDA, Dream, LLaDA-MoE and LLaDA2 are profiled alike."""

    def __init__(self, model: Any, device: torch.device, policy: Any = None, interval_s: float = 0.001,
                 live: LiveBytes | None = None) -> None:
        self.model = model
        self.live = live
        self.live_peaks: dict[tuple[int, str], int] = {}
        self.policy = policy
        self.device = device
        self.interval_s = interval_s
        self.label = "start"
        self.layer = -1
        self.peaks: dict[tuple[int, str], int] = {}
        self.order: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._patched: list[tuple[Any, str, Any | None]] = []
        self.exact = device.type == "cuda"
        self.highest = 0

    # sampling
    def _record(self) -> None:
        if self.exact:  # the allocator's peak since the last mark, then a fresh one for the next phase
            value = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            value = read_current(self.device)
        self.highest = max(self.highest, value)
        key = (self.layer, self.label)
        if key not in self.peaks:
            self.order.append(key)
            self.peaks[key] = value
        elif value > self.peaks[key]:
            self.peaks[key] = value

    def mark(self, label: str, layer: int | None = None) -> None:
        self._record()  # the end of the previous phase
        if self.live is not None:  # exact: the most live bytes since the previous mark
            key = (self.layer, self.label)
            self.live_peaks[key] = max(self.live_peaks.get(key, 0), self.live.take_window_peak())
        if layer is not None:
            self.layer = layer
        self.label = label
        self._record()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record()

    # hooks
    def _wrap(self, owner: Any, name: str, before: str, after: str, layer: int | None = None) -> None:
        real = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.mark(before, layer)
            out = real(*args, **kwargs)
            self.mark(after)
            return out

        self._patched.append((owner, name, real if name in vars(owner) else None))
        setattr(owner, name, wrapped)

    def __enter__(self) -> PhasePeaks:
        import torch.nn.functional as F

        import maskkv_cli.engine.selection as fwd

        for i, block in enumerate(self.model.blocks):  # the prefill's order: k, scores, v, select, attention
            self._wrap(block, "keys", "k projection + RoPE", "k projection + RoPE", i)
            self._wrap(block, "values", "v projection", "v projection")
            self._wrap(block, "queries", "q projection + RoPE", "after q")
            label = "attention output projection + residual"  # the residual add follows the projection
            self._wrap(block, "attn_proj", label, label)
            self._wrap(block, "mlp", "MLP", "MLP")  # the same: the MLP and its residual add
        self._wrap(self.model, "head", "LM head", "LM head", len(self.model.blocks))
        self._wrap(F, "scaled_dot_product_attention", "attention (SDPA)", "after attention")
        if self.policy is not None:
            self._wrap(self.policy, "scores", "scoring (policy votes)", "after scoring")
        self._wrap(fwd, "select_layer", "keep K/V (select)", "after keep")
        self._wrap(fwd, "dense_layer", "keep K/V (copy all)", "after keep")
        if not self.exact:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.mark("end")
        if self.live is not None:  # the "end" phase has no later mark: close its window here
            self.live_peaks[(self.layer, "end")] = self.live.take_window_peak()
        for owner, name, real in reversed(self._patched):
            if real is None:  # an instance method: drop the shadowing attribute
                delattr(owner, name)
            else:
                setattr(owner, name, real)

    def phases(self, base: int) -> list[dict[str, Any]]:
        """Per (layer, phase): RSS peak above ``base``, sampled (CUDA: the allocator's, exact); live tensor peak,
        exact."""
        out = []
        for layer, label in self.order:
            row: dict[str, Any] = {"layer": layer, "phase": label,
                                   "peak_above_weights_bytes": self.peaks[(layer, label)] - base}
            if self.live is not None:
                row["live_above_weights_bytes"] = self.live_peaks.get((layer, label), 0)
            out.append(row)
        return out


def prefill_input(model: Any, plan: Any, prompt: torch.Tensor, gen_length: int,
                  block_length: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(ids, rows, layout) of the sampler's step 0 over ``prompt`` as ``plan`` says, for any family: ``[prompt ;
    masks]`` and the first block's mask rows over a bidirectional model; for a block-causal one (LLaDA2) the
    window of the prompt's whole blocks and the first response block, with its block-causal layout (as
    ``sampling.forward.BlockForward`` runs it)."""
    from maskkv_cli.engine.lanes import Layout

    cfg, dev = model.config, prompt.device
    m = prompt.shape[1]
    if not cfg.block_causal:
        mask = torch.full((1, gen_length), cfg.mask_token_id, dtype=prompt.dtype, device=dev)
        rows = torch.arange(m, m + min(block_length, gen_length), device=dev)
        return torch.cat([prompt, mask], 1), rows, None
    total = -(-(m + gen_length) // block_length) * block_length  # the sampler's canvas: whole blocks
    end = plan.split + block_length  # the first response block ends here (it may start inside the prompt)
    mask = torch.full((1, end - m), cfg.mask_token_id, dtype=prompt.dtype, device=dev)
    layout = Layout(block=block_length, mask_start=m, response_slots=total - plan.split)
    return torch.cat([prompt, mask], 1), torch.arange(m, end, device=dev), layout


def run_memory_case(case: MemoryCase) -> dict[str, Any]:
    """One prefill (step 0) in this process; its memory row. Any family: the hooks are the engine's
    (``PhasePeaks``), the input and the plan its sampler's step 0 (``prefill_input``)."""
    from maskkv_cli.engine.plan import CachePlan
    from maskkv_cli.engine.prefill import prefill
    from maskkv_cli.models.base import kv_bytes_per_token
    from maskkv_cli.policies import get_policy
    from maskkv_cli.runtime.stats import now

    torch.set_num_threads(case.threads)
    dev = torch.device(case.device)
    started = time.time()
    model = load_bench_model(case.config, case.model, dev, case.dtype, case.seed, case.quantize)
    cfg = model.config
    policy = get_policy(case.policy)
    if not policy.uses_cache:
        raise UsageError("bench memory compares cached prefills; policy 'none' has no cache")
    m, n = case.prompt_len, case.gen_length
    if policy.evicts and case.budget is None:
        raise UsageError(f"policy {case.policy} needs a budget")
    # the sampler's step 0 over the cached segment (a block-causal model's: its whole blocks, in blocks)
    plan = CachePlan.build(model, policy, case.budget, m, block_length=min(case.block_length, n))
    layer_budgets = None if plan.layer_budgets is None else list(plan.layer_budgets)
    prompt = random_prompt(cfg, m, case.seed, dev)
    ids, rows, layout = prefill_input(model, plan, prompt, n, min(case.block_length, n))
    small_rows(str(dev), model.dtype)  # the engine's once-per-process probe (models/rows.py), not the prefill's memory
    now(dev)
    settle_memory(dev)
    loaded = read_current(dev)
    peak_reset = reset_peak(dev)
    live = LiveBytes()
    prof = PhasePeaks(model, dev, policy, live=live) if case.profile else None
    t0 = now(dev)
    with torch.no_grad(), live:
        if prof is not None:
            with prof:
                logits, cache, _ = prefill(model, ids, plan.split, policy, layer_budgets, rows, layout=layout)
        else:
            logits, cache, _ = prefill(model, ids, plan.split, policy, layer_budgets, rows, layout=layout)
    elapsed = now(dev) - t0
    peak = read_peak(dev) if prof is None else max(read_peak(dev), prof.highest)  # (CUDA's restarted per phase)
    after = read_current(dev)
    live_after = live.live
    del logits
    above = max(0, peak - loaded)
    kv = cache.prompt_nbytes()
    row: dict[str, Any] = {
        "key": case.key(),
        "method": case.method,
        **asdict(case),
        "mem_kind": "cuda" if dev.type == "cuda" else "rss",
        "weights_bytes": weights_bytes(model),
        "loaded_mem_bytes": loaded,
        "peak_reset": peak_reset,
        "peak_mem_bytes": peak,
        "peak_above_weights_bytes": above,
        "after_prefill_above_weights_bytes": after - loaded,
        "kv_bytes": kv,
        "kv_resident_bytes": cache.nbytes(),
        "kv_entries": cache.logical_entries(),
        "kv_full_bytes": kv_bytes_per_token(model) * plan.split,  # each layer's own heads x head size
        "kv_share": kv / above if above else None,
        "activation_bytes": max(0, above - cache.nbytes()),
        LIVE: live.peak,
        "live_after_prefill_bytes": live_after,
        "live_activation_bytes": max(0, live.peak - cache.nbytes()),
        "live_kv_share": kv / live.peak if live.peak else None,
        "prefill_s": elapsed,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }
    if prof is not None:
        phases = prof.phases(loaded)
        row["phases"] = phases
        top = max(phases, key=lambda p: p["live_above_weights_bytes"])
        row["peak_phase"] = f"layer {top['layer']}: {top['phase']}"
    return row


def run_memory_subprocess(case: MemoryCase, timeout: float | None = None) -> dict[str, Any]:
    return run_in_fresh_process("maskkv_cli.bench.memory", case.to_json(), case.threads,
                                f"memory case {case.method}", timeout)


@dataclass(frozen=True)
class MemorySettings:
    prompt_len: int = 16384
    budget: int = 256
    gen_length: int = 128
    block_length: int = 32
    policies: tuple[str, ...] = ("full", "maskkv")
    config: str | None = "llada-small"
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    threads: int = 1
    profile: bool = True
    quantize: str = "none"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["policies"] = list(d["policies"])
        if self.quantize == "none":
            del d["quantize"]  # a run finds its folder from before quantization
        return d

    def cases(self) -> list[MemoryCase]:
        from maskkv_cli.defaults import check_quantize
        from maskkv_cli.models.fingerprint import model_fingerprint
        from maskkv_cli.policies.base import get_policy
        from maskkv_cli.sampling.llada import GenerationConfig

        if self.prompt_len <= 0 or self.gen_length <= 0 or self.budget <= 0:
            raise UsageError("--prompt-length, --gen-length and --budget must be positive")
        if self.threads < 1:
            raise UsageError("--threads must be at least 1")
        GenerationConfig(self.gen_length, self.gen_length, self.block_length)  # the length in whole blocks
        check_quantize(self.quantize)
        model_id = model_fingerprint(self.model) if self.model else None
        out = []
        for name in self.policies:
            pol = get_policy(name)
            if not pol.uses_cache:
                raise UsageError("bench memory compares cached prefills; drop 'none' from --policies")
            out.append(MemoryCase(name, self.budget if pol.evicts else None, self.prompt_len, self.gen_length,
                                  self.block_length, None if self.model else self.config, self.model, self.device,
                                  self.dtype, self.seed, self.threads, self.profile, self.quantize, model_id))
        return out


def compare(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add to every row ``share_of_full`` (live peak above weights / full's), ``target_met`` (<= TARGET_SHARE)
    and, for reference, ``rss_share_of_full`` (the same ratio of the RSS or CUDA allocator peaks)."""
    full = next((r for r in rows if r["policy"] == "full"), None)
    out = []
    for r in rows:
        r = dict(r)
        r["share_of_full"] = r["target_met"] = r["rss_share_of_full"] = None
        if full and full.get(LIVE) and r.get(LIVE) is not None:
            r["share_of_full"] = r[LIVE] / full[LIVE]
            r["target_met"] = None if r["policy"] == "full" else r["share_of_full"] <= TARGET_SHARE
        if full and full["peak_above_weights_bytes"] > 0:
            r["rss_share_of_full"] = r["peak_above_weights_bytes"] / full["peak_above_weights_bytes"]
        out.append(r)
    return out


def check_engine_family(model: str) -> None:
    """Refuse, before anything loads, a model whose prefill is not the engine's (``Family.engine_lanes``:
    DiffusionGemma runs its own encoder and decoder), which is what this benchmark measures."""
    from maskkv_cli.models.checkpoint import ModelFolder
    from maskkv_cli.models.families import family

    cfg = ModelFolder.of(model).config
    if not family(cfg.family).engine_lanes:
        raise UsageError(f"bench memory measures the engine's prefill, which {cfg.family} models do not run; "
                         f"`maskkv plan --model {model}` gives their memory model and `maskkv bench speed --model "
                         f"{model}` their measured peak")


def run_memory(
    settings: MemorySettings,
    out: Path | None = None,
    fresh: bool = False,
    isolate: bool = True,
    on_case: Callable[[int, int, MemoryCase, dict[str, Any] | None], None] | None = None,
) -> tuple[ResultsFolder, list[dict[str, Any]]]:
    if settings.model:
        check_engine_family(settings.model)
    cases = settings.cases()
    folder = ResultsFolder.open("memory", settings.as_dict(), [c.key() for c in cases], out, fresh)
    for key in [k for k, row in folder.rows.items() if LIVE not in row]:  # measured before the live reading
        del folder.rows[key]
    folder.run_cases(cases, run_memory_subprocess if isolate else run_memory_case, on_case)
    rows = compare(folder.ordered())
    folder.update(rows)
    folder.write_text("summary.md", memory_markdown(settings, rows))
    return folder, rows


def memory_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    cuda = any(r.get("mem_kind") == "cuda" for r in rows)
    os_kind = "CUDA" if cuda else "RSS"
    head = ["method", f"weights ({os_kind} after load)", f"peak {os_kind}", f"{os_kind} above weights",
            "live tensors above weights", "KV kept", "KV share (live)", "share of full (live)",
            f"share of full ({os_kind})", "target", "peak reached in"]
    body = []
    for r in rows:
        share, rss_share = r.get("share_of_full"), r.get("rss_share_of_full")
        target = "-" if r.get("target_met") is None else ("met" if r["target_met"] else "missed")
        body.append([r["method"], mib(r["loaded_mem_bytes"]), mib(r["peak_mem_bytes"]),
                     mib(r["peak_above_weights_bytes"]), mib(r.get(LIVE)), mib(r["kv_bytes"]),
                     "-" if r.get("live_kv_share") is None else f"{100 * r['live_kv_share']:.1f}%",
                     "-" if share is None else f"{share:.3f}", "-" if rss_share is None else f"{rss_share:.3f}",
                     target, r.get("peak_phase", "-")])
    return head, body


def memory_markdown(settings: MemorySettings, rows: Sequence[dict[str, Any]]) -> str:
    s = settings
    head, body = memory_table(rows)
    what = f"checkpoint `{s.model}`" if s.model else f"random weights of the `{s.config}` shape"
    lines = [
        "# maskkv bench memory",
        "",
        f"- prefill (step 0) of prompt {s.prompt_len} + {s.gen_length} masks, budget {s.budget}; {what}, "
        f"dtype {s.dtype}, device {s.device}, {s.threads} thread(s); each case in a fresh process",
        "- live tensors = peak bytes of the tensors allocated in the prefill and not yet freed (exact, independent "
        "of the allocator); the target and `share of full (live)` use it",
        "- weights = memory right after loading (CPU: RSS); peak = VmHWM reset after loading (CPU) or "
        "CUDA max_memory_allocated; `RSS above weights` = peak - weights",
        f"- target: MaskKV's live peak above weights <= {TARGET_SHARE:.3f} of the full cache's",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    lines += ["| " + " | ".join(c) + " |" for c in body]
    for r in rows:
        if r.get("phases"):
            lines += ["", f"## {r['method']}: peak above weights per layer and phase", "",
                      "| layer | phase | live tensors | RSS / CUDA (sampled) |", "|---|---|---|---|"]
            lines += [f"| {p['layer']} | {p['phase']} | {mib(p.get('live_above_weights_bytes'))} | "
                      f"{mib(p['peak_above_weights_bytes'])} |" for p in r["phases"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return case_main(argv, "maskkv_cli.bench.memory", lambda text: run_memory_case(MemoryCase.from_json(text)))


if __name__ == "__main__":
    raise SystemExit(main())
