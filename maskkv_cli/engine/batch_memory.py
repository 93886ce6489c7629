"""How much memory a batch of sequences takes, and the largest batch that fits (``--batch-size auto``); the same
model gives ``maskkv plan``'s table (``engine/memory_table.py``).

The model (estimates from the shapes, no measurement; ``docs/performance.md`` checks each term by hand) for the
engine's families (LLaDA, Dream, LLaDA-MoE, LLaDA2): each sequence of a batch holds its compressed cache (the kept
prompt entries per key/value head and its response slot, keys and values, every layer with its own heads and head
size) and activations: the larger of its prefill rows through one layer (hidden state, keys and values of
``[prompt ; masks]``: prompts that join together share one prefill, ``engine/prefill.py``) and its step's rows (its
response through one layer, plus the LM head over its rows). Once per batch: the prefill's attention chunk (fp32
scores of one sequence's query chunk, as a kernel that forms them holds them; sequences are attended one at a
time) and its MLP chunk (with a mixture of experts, the routed copies of the chunk's rows too). Where layers differ
(``Geometry``), a layer's activations are those of the widest one.

DiffusionGemma (``Geometry.canvas``; ``diffusion_gemma_geometry``) runs otherwise: its sliding-window layers keep at
most W - 1 entries and are never evicted, only its full layers are; the response is denoised one canvas at a time
and joins the cache only when committed; and a cache the first step's votes cut is encoded layer by layer, each
full layer cut before the next is encoded, where that holds less (``sampling/diffusion_gemma_forward.py``: the
prompt's hidden states and one whole full layer at a time, never the whole cache; else, and for a cache kept whole,
chunk by chunk, every layer for one chunk). The encoder runs in chunks of ``ENCODER_CHUNK`` prompt tokens
(``DiffusionGemma.encode``), writing each full layer's entries in place into a store sized for the prompt (and, for
a cache kept whole, the canvases to come and the decoder's canvas: no copy at a commit or a step), its attention
masked in blocks of at most ``MASK_ELEMENTS`` entries (``models/diffusion_gemma_attention.py``) by kernels that form
no score matrix. So per sequence: the kept cache and one decoder step over the canvas (its rows, its fp32 logits
kept for self-conditioning, and the canvas's entries beside each layer's prompt entries: a copy of a cut or sliding
layer's, the room of a whole one); once per batch (one sequence is prefilled at a time): for a cut cache the
rest of the full layers before their cut (one at a time, and the prompt's hidden states, layer by layer), and the
larger of the encoder's chunk and the first step's votes. A document kept for later questions (``DocumentCache``)
holds its whole cache besides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from maskkv_cli.engine.chunks import MLP_CHUNK, QUERY_CHUNK
from maskkv_cli.errors import UsageError
from maskkv_cli.models.diffusion_gemma_config import ENCODER_CHUNK, MASK_ELEMENTS

if TYPE_CHECKING:  # this module imports no torch at load: the CLI parses --batch-size before anything heavy
    import torch

    from maskkv_cli.models.config import ModelConfig
    from maskkv_cli.models.diffusion_gemma_config import DiffusionGemmaConfig
    from maskkv_cli.models.protocol import DiffusionLM

MAX_AUTO_BATCH = 64  # ``auto`` never goes beyond this many sequences at once
FREE_SHARE = 0.8  # of the free memory a batch may plan to use (allocator slack, fragmentation, the rest)
VOTE_CHUNKS = 2 * 4 * (1 << 22)  # two fp32 chunks of attention probabilities while votes are summed (kv/votes.py)
LOGIT_COPIES = 3  # DiffusionGemma's step: its fp32 logits, the previous step's (self-conditioning) and a softmax


@dataclass(frozen=True)
class Geometry:
    """The shapes the memory model reads: the sums and maxima of every layer's own geometry."""

    d_model: int
    mlp_hidden: int
    vocab: int
    kv_per_token: int  # key and value values of one position, summed over the layers whose cache grows
    widest_kv: int  # the most key and value values of one position in one layer
    widest_q: int  # the most query values of one position in one layer
    most_heads: int  # the most query heads of one layer
    # (key and value values of one position summed over the layers that keep at most ``cap`` entries, ``cap``):
    # sliding-window layers, never evicted
    capped: tuple[tuple[int, int], ...] = ()
    moe_top_k: int = 0  # experts per token of a mixture of experts (0: no experts)
    canvas: int = 0  # DiffusionGemma's canvas length (0: the engine's families; see the module doc)
    growing_kv: int | None = None  # the most key and value values of one position in one growing layer (None: widest)
    widest_group: int = 1  # the most query heads per key/value head of one layer (DiffusionGemma's masks, folded)
    layer_by_layer: bool = False  # DiffusionGemma: a cut cache is encoded layer by layer (``cuts_layer_by_layer``)

    @property
    def widest_growing_kv(self) -> int:
        return self.widest_kv if self.growing_kv is None else self.growing_kv


def model_geometry(model: DiffusionLM) -> Geometry:
    """``Geometry`` from each block's own heads and head size (DiffusionGemma: from its config)."""
    from maskkv_cli.models.diffusion_gemma_config import DiffusionGemmaConfig

    cfg = model.config
    if isinstance(cfg, DiffusionGemmaConfig):
        return diffusion_gemma_geometry(cfg)
    if cfg.family_config is not None:  # a loaded DiffusionGemma's ModelConfig carries its own config
        return diffusion_gemma_geometry(cfg.family_config)
    blocks = list(model.blocks)
    moe = getattr(cfg, "moe", None)
    return Geometry(cfg.d_model, cfg.mlp_hidden_size, cfg.vocab_size,
                    sum(2 * b.n_kv_heads * b.head_dim for b in blocks),
                    max(2 * b.n_kv_heads * b.head_dim for b in blocks),
                    max(b.n_heads * b.head_dim for b in blocks), max(b.n_heads for b in blocks),
                    moe_top_k=moe.top_k if moe is not None and any(moe.layers) else 0)


def config_geometry(cfg: ModelConfig | DiffusionGemmaConfig) -> Geometry:
    """``Geometry`` of a config, for planning without weights: one whose layers are all alike (the families of
    ``models/config.py``), or a DiffusionGemma config (``diffusion_gemma_geometry``)."""
    from maskkv_cli.models.diffusion_gemma_config import DiffusionGemmaConfig

    if isinstance(cfg, DiffusionGemmaConfig):
        return diffusion_gemma_geometry(cfg)
    if cfg.family_config is not None:
        return diffusion_gemma_geometry(cfg.family_config)
    n_kv = cfg.n_kv_heads or cfg.n_heads
    kv = 2 * n_kv * cfg.head_dim
    moe = cfg.moe
    return Geometry(cfg.d_model, cfg.mlp_hidden_size, cfg.vocab_size, cfg.n_layers * kv, kv,
                    cfg.n_heads * cfg.head_dim, cfg.n_heads,
                    moe_top_k=moe.top_k if moe is not None and any(moe.layers) else 0)


def diffusion_gemma_geometry(cfg: DiffusionGemmaConfig) -> Geometry:
    """``Geometry`` of DiffusionGemma from each layer's own kind, KV heads and head dim (``cfg.layer(i)``): the full
    layers grow (``kv_per_token``), the sliding ones are capped at W - 1 entries (``capped``)."""
    layers = cfg.layers
    kv = [2 * spec.n_kv_heads * spec.head_dim for spec in layers]
    caps: dict[int, int] = {}
    for spec, width in zip(layers, kv, strict=True):
        cap = spec.cached_prompt_entries
        if cap is not None:
            caps[cap] = caps.get(cap, 0) + width
    growing = [width for spec, width in zip(layers, kv, strict=True) if spec.cached_prompt_entries is None]
    return Geometry(cfg.d_model, cfg.mlp_hidden_size, cfg.vocab_size, sum(growing), max(kv),
                    max(cfg.n_heads * spec.head_dim for spec in layers), cfg.n_heads,
                    capped=tuple((width, cap) for cap, width in sorted(caps.items())), moe_top_k=cfg.top_k_experts,
                    canvas=cfg.canvas_length, growing_kv=max(growing, default=0),
                    widest_group=max(cfg.n_heads // spec.n_kv_heads for spec in layers),
                    layer_by_layer=cfg.cuts_layer_by_layer)


@dataclass(frozen=True)
class BatchMemory:
    """Bytes of one batch by the memory model: per sequence (cache, step) and once (the prefill's peak)."""

    cache_per_sequence: int  # compressed K/V of one sequence, every layer (kept entries + response slot)
    # activations of one sequence: the larger of its prefill rows and its step's rows (DiffusionGemma: one step)
    step_per_sequence: int
    # once per batch: the prefill's attention chunk and MLP chunk (DiffusionGemma: the rest of the full cache
    # before the cut, and the larger of the encoder's chunk and the first step's extra copy)
    prefill_peak: int
    terms: dict[str, int] = field(default_factory=dict, compare=False)  # the parts of the three, by name

    def total(self, batch: int) -> int:
        return batch * (self.cache_per_sequence + self.step_per_sequence) + self.prefill_peak


def moe_chunk_bytes(shapes: Geometry, rows: int, element_bytes: int) -> int:
    """The routed copies of ``rows`` tokens through a mixture of experts (``models/moe.py``, DiffusionGemma's
    ``Experts``): top-k copies of each row, the experts' outputs and the outputs back in token order in the
    model's dtype, then the cast to fp32 and its weighted product (the routing weights are fp32 for LLaDA2 and
    DiffusionGemma; LLaDA-MoE's are in the model's dtype, so this counts it high)."""
    return rows * shapes.moe_top_k * shapes.d_model * (3 * element_bytes + 8)


def batch_memory(shapes: Geometry, prompt_len: int, gen_length: int, kept: int,
                 element_bytes: int) -> BatchMemory:
    """The memory model for prompts of ``prompt_len`` tokens, ``gen_length`` response tokens and ``kept`` prompt
    entries per head (the budget; the prompt length with the full cache), in ``element_bytes`` per value."""
    if shapes.canvas:
        return _canvas_memory(shapes, prompt_len, gen_length, kept, element_bytes)
    g, b = shapes, element_bytes
    slot = min(kept, prompt_len) + gen_length
    grown = g.kv_per_token * b * slot
    capped = sum(width * b * min(prompt_len + gen_length, cap) for width, cap in g.capped)
    width = g.d_model + g.widest_kv + g.widest_q + 3 * g.mlp_hidden
    step = gen_length * width * b + gen_length * g.vocab * 4 + moe_chunk_bytes(g, gen_length, b)
    t = prompt_len + gen_length
    prefill_rows = t * (g.d_model * 2 + g.widest_kv) * b
    scores = 4 * min(t, QUERY_CHUNK) * t * g.most_heads
    mlp = MLP_CHUNK * 3 * g.mlp_hidden * b + moe_chunk_bytes(g, MLP_CHUNK, b)
    terms = {"cache: growing layers": grown, "cache: capped layers": capped, "step rows": step,
             "prefill rows": prefill_rows, "attention scores chunk": scores, "mlp chunk": mlp}
    return BatchMemory(grown + capped, max(step, prefill_rows), scores + mlp, terms)


def _canvas_memory(shapes: Geometry, prompt_len: int, gen_length: int, kept: int,
                   element_bytes: int) -> BatchMemory:
    """``batch_memory`` of DiffusionGemma (see the module doc)."""
    g, b, c = shapes, element_bytes, shapes.canvas
    committed = (max(1, math.ceil(gen_length / c)) - 1) * c  # canvases that joined the cache before the last one
    held = min(kept, prompt_len)
    whole = held >= prompt_len  # nothing cut: the full layers' stores keep room for the canvas
    grown = g.kv_per_token * b * (held + committed)
    capped = sum(width * b * min(prompt_len + committed, cap) for width, cap in g.capped)
    width = g.d_model + g.widest_kv + g.widest_q + 3 * g.mlp_hidden
    norm = 2 * g.widest_q * 4  # per row: Gemma's RMSNorm of the queries in fp32 (the upcast and its product)
    step_rows = c * (width * b + norm) + moe_chunk_bytes(g, c, b)
    logits = LOGIT_COPIES * c * g.vocab * 4
    # the canvas's entries beside a layer's visible prompt entries: a copy of a sliding (or cut full) layer's, one at
    # a time; a whole full layer writes them into its store's room instead (every full layer keeps that room)
    copies = [g.widest_kv * b * (min(prompt_len + committed, cap) + c) for _, cap in g.capped]
    if not whole:
        copies.append(g.widest_growing_kv * b * (held + committed + c))
    step_copy = max(copies, default=0)
    room = g.kv_per_token * b * c if whole else 0
    # before the cut, the full layers' stores hold the prompt and room for the canvas. Encoded layer by layer (where
    # that holds less: ``Geometry.layer_by_layer``), the first step's votes cutting each full layer before the next
    # is encoded: the prompt's hidden states, and one full layer whole beside the kept entries of the others; else
    # every full layer whole until the first step has cut them
    layered = not whole and g.layer_by_layer
    hidden = prompt_len * g.d_model * b if layered else 0
    whole_layers = g.widest_growing_kv if layered else g.kv_per_token
    excess = 0 if whole else whole_layers * b * (prompt_len + c - held)
    n = min(prompt_len, ENCODER_CHUNK)  # the prompt's last encoder chunk, over all of the prompt before it
    m = prompt_len
    mask = min(n * m * g.widest_group, MASK_ELEMENTS) * (1 + b)  # a block's boolean mask and SDPA's additive one
    encoder = n * (width * b + norm) + moe_chunk_bytes(g, n, b) + mask  # rows, routed copies, the mask
    # the votes: the keys over [prompt ; canvas] in fp32 (a copy unless they are), and two chunks of probabilities
    keys32 = 0 if b == 4 else g.widest_growing_kv // 2 * 4 * (prompt_len + c)
    first_step = 0 if whole else keys32 + VOTE_CHUNKS
    terms = {"cache: growing layers": grown, "cache: capped layers": capped, "step rows": step_rows,
             "step logits": logits, "step cache copy": step_copy, "step canvas room": room,
             "full cache before the cut": excess, "prompt hidden states": hidden, "encoder chunk": encoder,
             "encoder mask block": mask, "first step votes": first_step}
    return BatchMemory(grown + capped, step_rows + logits + step_copy + room,
                       hidden + excess + max(encoder, first_step), terms)


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
