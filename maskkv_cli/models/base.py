"""What every model family shares: RoPE tables, RMSNorm, the block contract and the one dense layer loop.

A family's block supplies small hooks (its pre-attention norm, the q/k/v projections in head layout, its RoPE
rotation, the output projection, the feed-forward network); ``DiffusionBlock`` builds on them everything the
engine calls, once for every family:

- ``queries(x, rope)``, ``keys(x, rope)``, ``values(x)``: what the layer-streamed prefill computes separately
  (and a chunk of rows at a time) to bound its memory;
- ``qkv(x, rope)``: the three at once (one norm), for the response-only steps;
- ``attn_proj(o)``, ``mlp(x, chunk)``;
- ``forward(x, rope, ...)``: one dense bidirectional layer.

Because ``queries``/``keys``/``qkv`` all go through the same ``rotate`` hook, the cached path and the plain
forward rotate identically in every dtype. ``attention`` decides grouped-query attention in one place (from the
head counts of q and k). ``dense_hidden`` is the one dense layer loop: the families' ``forward``, the plain
logits of policy ``none``, the layer-importance measurement and the limit line all run it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import ClassVar, NamedTuple, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maskkv_cli.models.config import ModelConfig
from maskkv_cli.models.rows import Linear


class Rope(NamedTuple):
    """fp32 cos/sin tables (T, head_dim) for T positions; unpacks as ``cos, sin``."""

    cos: Tensor
    sin: Tensor

    def rows(self, start: int, stop: int) -> Rope:
        """The tables of positions [start, stop) of these T."""
        return Rope(self.cos[start:stop], self.sin[start:stop])

    def to(self, device: torch.device) -> Rope:
        return self if self.cos.device == device else Rope(self.cos.to(device), self.sin.to(device))


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> Rope:
    """fp32 cos/sin tables (T, head_dim) in the half-split layout for integer ``positions`` (T,)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return Rope(angles.cos(), angles.sin())


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate ``x`` (B, H, T, D) in fp32 with the ``rotate_half`` convention; returns x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * rope.cos + rotated * rope.sin).to(x.dtype)


def rotate_in_dtype(x: Tensor, rope: Rope, rotary_dim: int | None = None) -> Tensor:
    """RoPE as the Qwen2-style upstream models apply it (Dream, LLaDA2, LLaDA-MoE): in fp32 (``apply_rope``) for
    fp32 activations; in half precision the fp32 tables are cast to the activation dtype and the rotation runs in
    it. With ``rotary_dim`` below the head dim only the first ``rotary_dim`` dims are rotated (half-split within
    them) and the rest pass through (the tables then have ``rotary_dim`` columns)."""
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        return torch.cat((rotate_in_dtype(x[..., :rotary_dim], rope), x[..., rotary_dim:]), dim=-1)
    if x.dtype == torch.float32:
        return apply_rope(x, rope)
    c, s = rope.cos.to(x.dtype), rope.sin.to(x.dtype)
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; parameter names as in every upstream checkpoint."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = Linear(d_model, hidden, bias=False)
        self.up_proj = Linear(d_model, hidden, bias=False)
        self.down_proj = Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype, then scaled."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def folds_groups(q: Tensor, k: Tensor) -> bool:
    """Whether ``attention`` folds the query heads of a KV head into its rows by default (CUDA, grouped heads)."""
    return q.device.type == "cuda" and q.shape[1] != k.shape[1]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
              fold: bool | None = None) -> Tensor:
    """SDPA of q (B, H, R, D) over k, v (B, H_kv, S, D); query head h reads KV head h // g (g = H / H_kv).

    ``mask``: bool (True = may attend) or an additive float bias, (R, S) for every head or (B or 1, 1 or H or H_kv,
    R or 1, S). ``scale``: the softmax scale (None: 1 / sqrt(D)). Where SDPA takes grouped heads without copying
    them (the CPU's flash kernel) it is asked for them; on CUDA (``fold`` None: there) each KV head's query heads are
    folded into its rows, (B, H_kv, g R, D): the math kernel would repeat the keys and values g times and form the
    scores of every head, and the memory-efficient kernel, which takes masks and fp32, does not take grouped
    heads. Folding moves rows, not sums: each row's result is the same up to the kernel's rounding."""
    b, h, r, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    if fold is None:
        fold = folds_groups(q, k)
    if g == 1 or not fold:
        if mask is not None and mask.dim() == 4 and mask.shape[1] not in (1, h):  # per KV head -> per query head
            mask = mask.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g > 1)
    folded = q.reshape(b, hkv, g * r, d)  # row j R + i: query head (KV head) g + j, row i
    if mask is not None:
        if mask.dim() == 2:  # (R, S) -> (g R, S)
            mask = mask.repeat(g, 1)
        elif mask.shape[1] == h:  # per query head (B, H, R or 1, S) -> (B, H_kv, g R, S)
            mask = mask.expand(mask.shape[0], h, r, s).reshape(mask.shape[0], hkv, g * r, s)
        elif mask.shape[2] != 1:  # every head's or a KV head's rows (B, 1 or H_kv, R, S) -> (B, H_kv, g R, S)
            mask = mask[:, :, None].expand(mask.shape[0], mask.shape[1], g, r, s).reshape(
                mask.shape[0], mask.shape[1], g * r, s)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, h, r, out.shape[-1])  # CUDA's kernels return it laid out (B, g R, H_kv, D): not a view


class DiffusionBlock(nn.Module):
    """One transformer layer of a bidirectional family, built on the family's hooks (see the module doc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.n_kv_heads: int = cfg.n_kv_heads  # type: ignore[assignment]

    @property
    def attention_scale(self) -> float:
        """The softmax scale of this layer's attention logits (SDPA's default, ``1 / sqrt(head_dim)``)."""
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    # ----- the family's hooks ---------------------------------------------------------------------
    def attention_input(self, x: Tensor) -> Tensor:
        """The pre-attention normalisation of the hidden state x (B, T, d)."""
        raise NotImplementedError

    def q_heads(self, n: Tensor) -> Tensor:
        """Unrotated queries (B, H, T, D) of the normalised input n (B, T, d)."""
        raise NotImplementedError

    def k_heads(self, n: Tensor) -> Tensor:
        """Unrotated keys (B, H_kv, T, D) of n."""
        raise NotImplementedError

    def v_heads(self, n: Tensor) -> Tensor:
        """Values (B, H_kv, T, D) of n."""
        raise NotImplementedError

    def rotate(self, t: Tensor, rope: Rope) -> Tensor:
        """The family's RoPE: rotate queries or keys (B, heads, T, D) by the tables of their T positions."""
        raise NotImplementedError

    def attn_proj(self, o: Tensor) -> Tensor:
        """Output projection of the attention o (B, H, T, D) -> (B, T, d)."""
        raise NotImplementedError

    def feed_forward(self, x: Tensor) -> Tensor:
        """The MLP sub-layer (its own norm included) of x (B, T, d); row-wise."""
        raise NotImplementedError

    # ----- what the engine calls --------------------------------------------------------------------
    @staticmethod
    def merge_heads(o: Tensor) -> Tensor:
        """(B, H, T, D) -> (B, T, H * D): the attention output as the output projection takes it."""
        b, _, t, _ = o.shape
        return o.transpose(1, 2).reshape(b, t, -1)

    def heads(self, t: Tensor, n_heads: int) -> Tensor:
        """(B, T, n_heads * D) -> (B, n_heads, T, D)."""
        b, length, _ = t.shape
        return t.view(b, length, n_heads, self.head_dim).transpose(1, 2)

    def queries(self, x: Tensor, rope: Rope) -> Tensor:
        """Rotated q (B, H, T, D) of x (B, T, d)."""
        return self.rotate(self.q_heads(self.attention_input(x)), rope)

    def keys(self, x: Tensor, rope: Rope) -> Tensor:
        """Rotated k (B, H_kv, T, D) of x (B, T, d)."""
        return self.rotate(self.k_heads(self.attention_input(x)), rope)

    def values(self, x: Tensor) -> Tensor:
        """v (B, H_kv, T, D) of x (B, T, d)."""
        return self.v_heads(self.attention_input(x))

    def qkv(self, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
        """``queries``, ``keys`` and ``values`` of x with one normalisation."""
        n = self.attention_input(x)
        return self.rotate(self.q_heads(n), rope), self.rotate(self.k_heads(n), rope), self.v_heads(n)

    def mlp(self, x: Tensor, chunk: int | None = None) -> Tensor:
        """``feed_forward(x)``; with ``chunk`` the sequence is processed in slices of that many rows."""
        if chunk is None or x.shape[1] <= chunk:
            return self.feed_forward(x)
        return torch.cat([self.feed_forward(x[:, i : i + chunk]) for i in range(0, x.shape[1], chunk)], dim=1)

    def forward(self, x: Tensor, rope: Rope, key_mask: Tensor | None = None, mlp_chunk: int | None = None,
                on_attention: Callable[[Tensor, Tensor], None] | None = None) -> Tensor:
        """One dense layer: ``h = x + attn_proj(attention)``, then ``h + mlp(h)``.

        ``key_mask`` (B, 1, 1, T) bool, True = may be attended (padding in training batches);
        ``on_attention(x, attn)`` sees the layer input and the attention sub-layer's output before they are added.
        """
        q, k, v = self.qkv(x, rope)
        attn = self.attn_proj(attention(q, k, v, key_mask))
        del q, k, v
        if on_attention is not None:
            on_attention(x, attn)
        x = x + attn
        del attn
        return x + self.mlp(x, mlp_chunk)


class HFLayoutBlock(DiffusionBlock):
    """A block in the Hugging Face layout (Dream, LLaDA2, LLaDA-MoE): ``input_layernorm`` before attention,
    ``post_attention_layernorm`` and the MLP module ``mlp_layers`` (upstream's ``mlp``; ``mlp`` is the method the
    engine calls) after it. The family creates them (in its checkpoint's order: random inits follow it)."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    mlp_layers: nn.Module

    def attention_input(self, x: Tensor) -> Tensor:
        return self.input_layernorm(x)

    def feed_forward(self, x: Tensor) -> Tensor:
        return self.mlp_layers(self.post_attention_layernorm(x))


def on_layer_device(model: nn.Module, i: int, x: Tensor, rope: Rope) -> tuple[Tensor, Rope]:
    """Move the hidden state and the RoPE tables to layer ``i``'s device when the model is spread over several
    (``placement.py``); a no-op otherwise."""
    devices = getattr(model, "layer_devices", None)
    if not devices or x.device == devices[i]:
        return x, rope
    return x.to(devices[i]), rope.to(devices[i])


LayerHook = Callable[[int, Tensor, Tensor], None]  # (layer, input hidden state, attention output)


def dense_hidden(model: DiffusionModel, ids: Tensor, key_mask: Tensor | None = None,
                 positions: Tensor | None = None, mlp_chunk: int | None = None,
                 on_attention: LayerHook | None = None, attn_mask: Tensor | None = None) -> Tensor:
    """The dense forward over ids (B, T): final hidden states (B, T, d) before the head.

    ``key_mask`` (B, T) bool marks real tokens (padding in training batches); ``attn_mask`` (T, T) bool says which
    keys each query may see (a block-causal model's generation window; None: bidirectional); ``positions`` (T,)
    are the RoPE positions (default 0..T-1); ``mlp_chunk`` bounds the MLP's rows at once; ``on_attention(i, x,
    attn)`` sees each layer's attention input and output (the layer importance is measured through it)."""
    x = model.embed(ids)
    pos = torch.arange(ids.shape[1], device=ids.device) if positions is None else positions
    tables: dict[object, Rope] = {}  # each kind of layer's RoPE tables (``rope_kind``), computed once
    mask = None if key_mask is None else key_mask[:, None, None, :]
    if attn_mask is not None:
        mask = attn_mask[None, None] if mask is None else mask & attn_mask[None, None]
    for i, block in enumerate(model.blocks):
        kind = model.rope_kind(i)
        if kind not in tables:
            tables[kind] = model.layer_rope(i, pos)
        x, rope = on_layer_device(model, i, x, tables[kind])
        rope = tables[kind] = rope.to(x.device)
        hook = None if on_attention is None else (lambda h, a, i=i: on_attention(i, h, a))  # type: ignore[misc]
        if mask is not None:
            mask = mask.to(x.device)
        x = block(x, rope, mask, mlp_chunk, hook)
    return x


class DiffusionModel(nn.Module):
    """What the families' models share: RoPE, the plain forward (with the family's logit shift), placement.

    A family sets ``config`` and implements ``blocks``, ``embed``, ``head``, ``place_ends``, ``device``,
    ``dtype``, ``checkpoint_key`` and ``parameter_name`` (``models.protocol.DiffusionLM``)."""

    config: ModelConfig
    layer_devices: list[torch.device] | None = None  # one device per layer under a device map (``placement.py``)
    optional_keys: tuple[str, ...] = ()  # checkpoint key endings a checkpoint may leave out (loaded as zeros)

    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def embed(self, ids: Tensor) -> Tensor:
        raise NotImplementedError

    def head(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def rope(self, positions: Tensor, factor: float = 1.0) -> Rope:
        """Tables for the rotated dims of each head (all of them unless ``partial_rotary_factor`` < 1); ``factor``
        scales the RoPE base (NTK-style, ``--long rope-scale``) for a prompt longer than the training window."""
        return rope_tables(positions, self.config.rotary_dim, self.config.rope_theta * factor)

    def rope_kind(self, layer: int) -> object:
        """Which RoPE tables layer ``layer`` rotates with: layers of one kind share them (every layer, here; a
        family whose layers rotate differently returns a key per kind and overrides ``layer_rope``)."""
        return None

    def layer_rope(self, layer: int, positions: Tensor, factor: float = 1.0) -> Rope:
        """The tables layer ``layer`` rotates the given positions with."""
        return self.rope(positions, factor)

    def forward(self, ids: Tensor, key_mask: Tensor | None = None, rows: Tensor | None = None,
                positions: Tensor | None = None) -> Tensor:
        """Logits (B, T, V); with ``rows`` (B, R) only at those positions; ``key_mask`` (B, T) marks real tokens;
        ``positions`` (T,) are the RoPE positions (default 0..T-1; training may skip some).

        Position i is predicted from hidden state ``i - logit_shift`` (the first positions from hidden state 0)."""
        x = dense_hidden(self, ids, key_mask, positions)
        shift = self.config.logit_shift
        if rows is None:
            if shift:
                x = x[:, (torch.arange(ids.shape[1], device=x.device) - shift).clamp(min=0)]
            return self.head(x)
        if shift:
            rows = (rows - shift).clamp(min=0)
        return self.head(torch.gather(x, 1, rows.to(x.device)[..., None].expand(-1, -1, x.shape[-1])))

    def init_weights(self, seed: int = 0, std: float = 0.02) -> Self:
        init_parameters(self, seed, std)
        return self


class HFLayoutModel(DiffusionModel):
    """A model in the Hugging Face layout (Dream, LLaDA2, LLaDA-MoE): ``model.<embedding>``, ``model.layers``,
    ``model.norm`` and an untied ``lm_head``; the family gives the blocks and the embedding's name."""

    embedding_name: ClassVar[str] = "embed_tokens"

    def __init__(self, cfg: ModelConfig, blocks: Iterable[nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict({
            self.embedding_name: nn.Embedding(cfg.vocab_size, cfg.d_model),
            "layers": nn.ModuleList(blocks),
            "norm": RMSNorm(cfg.d_model, cfg.rms_norm_eps),
        })
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model["layers"]  # type: ignore[return-value]

    def embed(self, ids: Tensor) -> Tensor:
        return self.model[self.embedding_name](ids)

    def head(self, x: Tensor) -> Tensor:
        """Final norm and LM head of hidden states (the logit shift, if any, is the caller's)."""
        return self.lm_head(self.model["norm"](x))

    def place_ends(self, first: torch.device, last: torch.device) -> None:
        self.model[self.embedding_name].to(first)
        self.model["norm"].to(last)
        self.lm_head.to(last)

    @property
    def device(self) -> torch.device:
        """Where the embedding (the input) lives: a device map's first device, as the protocol says."""
        return self.model[self.embedding_name].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype


def kv_bytes_per_token(model: DiffusionModel) -> int:
    """Bytes of the keys and values of one position over every layer, in the model's dtype, from each layer's own
    key/value heads and head size (what a full prompt cache holds per token)."""
    element = torch.finfo(model.dtype).bits // 8
    return sum(2 * block.n_kv_heads * block.head_dim for block in model.blocks) * element


def init_parameters(model: nn.Module, seed: int, std: float) -> None:
    """Random normal weights (norm weights at one, biases at zero), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)
