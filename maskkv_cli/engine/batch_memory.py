"""How much memory a batch of sequences takes, and the largest batch that fits (``--batch-size auto``).

The model (estimates from the shapes, no measurement): each sequence of a batch holds its compressed cache (the
kept prompt entries per key/value head and its response slot, keys and values, every layer with its own heads and
head size) and activations: the larger of its prefill rows through one layer (hidden state, keys and values of
``[prompt ; masks]``: prompts that join together share one prefill, ``engine/prefill.py``) and its step's rows (its
response through one layer, plus the LM head over its rows). Once per batch: the prefill's attention chunk (fp32
scores of one sequence's query chunk, sequences are attended one at a time) and its MLP chunk. Where layers differ
(``Geometry``), a layer's activations are those of the widest one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from maskkv_cli.engine.chunks import MLP_CHUNK, QUERY_CHUNK
from maskkv_cli.errors import UsageError

if TYPE_CHECKING:  # this module imports no torch at load: the CLI parses --batch-size before anything heavy
    import torch

    from maskkv_cli.models.config import ModelConfig
    from maskkv_cli.models.protocol import DiffusionLM

MAX_AUTO_BATCH = 64  # ``auto`` never goes beyond this many sequences at once
FREE_SHARE = 0.8  # of the free memory a batch may plan to use (allocator slack, fragmentation, the rest)


@dataclass(frozen=True)
class Geometry:
    """The shapes the memory model reads: the sums and maxima of every layer's own geometry."""

    d_model: int
    mlp_hidden: int
    vocab: int
    kv_per_token: int  # key and value values of one position, summed over the layers
    widest_kv: int  # the most key and value values of one position in one layer
    widest_q: int  # the most query values of one position in one layer
    most_heads: int  # the most query heads of one layer


def model_geometry(model: DiffusionLM) -> Geometry:
    """``Geometry`` from each block's own heads and head size."""
    blocks = list(model.blocks)
    cfg = model.config
    return Geometry(cfg.d_model, cfg.mlp_hidden_size, cfg.vocab_size,
                    sum(2 * b.n_kv_heads * b.head_dim for b in blocks),
                    max(2 * b.n_kv_heads * b.head_dim for b in blocks),
                    max(b.n_heads * b.head_dim for b in blocks), max(b.n_heads for b in blocks))


def config_geometry(cfg: ModelConfig) -> Geometry:
    """``Geometry`` of a config whose layers are all alike (the families of ``models/config.py``), for planning
    without weights."""
    n_kv = cfg.n_kv_heads or cfg.n_heads
    kv = 2 * n_kv * cfg.head_dim
    return Geometry(cfg.d_model, cfg.mlp_hidden_size, cfg.vocab_size, cfg.n_layers * kv, kv,
                    cfg.n_heads * cfg.head_dim, cfg.n_heads)


@dataclass(frozen=True)
class BatchMemory:
    """Bytes of one batch by the memory model: per sequence (cache, step) and once (the prefill's peak)."""

    cache_per_sequence: int  # compressed K/V of one sequence, every layer (kept entries + response slot)
    step_per_sequence: int  # activations of one sequence: the larger of its prefill rows and its step's rows
    prefill_peak: int  # once per batch: the prefill's attention chunk and MLP chunk

    def total(self, batch: int) -> int:
        return batch * (self.cache_per_sequence + self.step_per_sequence) + self.prefill_peak


def batch_memory(shapes: Geometry, prompt_len: int, gen_length: int, kept: int,
                 element_bytes: int) -> BatchMemory:
    """The memory model for prompts of ``prompt_len`` tokens, ``gen_length`` response tokens and ``kept`` prompt
    entries per head (the budget; the prompt length with the full cache), in ``element_bytes`` per value."""
    g = shapes
    cache = g.kv_per_token * element_bytes * (min(kept, prompt_len) + gen_length)
    width = g.d_model + g.widest_kv + g.widest_q + 3 * g.mlp_hidden
    step = gen_length * width * element_bytes + gen_length * g.vocab * 4
    t = prompt_len + gen_length
    prefill_rows = t * (g.d_model * 2 + g.widest_kv) * element_bytes
    once = 4 * min(t, QUERY_CHUNK) * t * g.most_heads + MLP_CHUNK * 3 * g.mlp_hidden * element_bytes
    return BatchMemory(cache, max(step, prefill_rows), once)


def free_bytes(device: torch.device) -> int:
    """Free memory of ``device``: the CUDA driver's count, else the system's available memory."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def auto_batch_size(memory: BatchMemory, free: int, jobs: int) -> tuple[int, str]:
    """The largest batch (at most ``jobs`` and ``MAX_AUTO_BATCH``) whose memory fits ``FREE_SHARE`` of ``free``
    bytes, and a line saying how it was chosen."""
    from maskkv_cli.runtime.sizes import human_size

    room = int(free * FREE_SHARE) - memory.prefill_peak
    per = memory.cache_per_sequence + memory.step_per_sequence
    fits = max(1, room // per) if room > 0 else 1
    limit = min(fits, MAX_AUTO_BATCH)
    size = min(limit, max(1, jobs))
    if size == jobs:
        reason = f"all {jobs} prompts at once; {limit} would fit"
    elif limit == fits:
        reason = "the most that fits"
    else:
        reason = f"the cap of {MAX_AUTO_BATCH}; {fits} would fit"
    return size, (f"batch size auto: {size} ({reason}; by the memory model {human_size(per, binary=True)} per "
                  f"sequence and {human_size(memory.prefill_peak, binary=True)} once, of "
                  f"{human_size(free, binary=True)} free)")


def parse_batch_size(value: str | int | None) -> int | None:
    """``--batch-size``: a positive number, or ``auto`` (None: chosen by ``auto_batch_size``)."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        size = int(value)
    except ValueError:
        raise UsageError(f"--batch-size must be a positive number or auto, got {value!r}") from None
    if size < 1:
        raise UsageError(f"--batch-size must be a positive number or auto, got {value!r}")
    return size
