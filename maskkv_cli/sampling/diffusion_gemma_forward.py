"""DiffusionGemma's prompt through the encoder and the first denoising step, and the forward that answers its loop.

Two ways to the same numbers (the same chunks, the same operations on the same values: equal to the bit, tested):

- ``encode_whole``: the encoder chunk by chunk (every layer for a chunk, then the next chunk), the whole prompt's
  cache written before anything reads it; then ``diffusion_gemma_kv.first_step_compressing`` cuts each full layer
  as the first step reaches it. At the peak every full layer holds the whole prompt.
- ``encode_and_cut``: the encoder **layer by layer** (every chunk through layer l, the prompt's hidden states
  kept in place of every layer's cache), interleaved with the first step's pass: once layer l holds the prompt, the
  canvas runs through its decoder layer l, whose votes cut it (a full layer) before layer l + 1 is encoded. At the
  peak the memory holds the prompt's hidden states and one full layer's whole cache, the layers before it already
  cut: the paper's "the full cache is never resident". Only a run whose first step cuts can take it (a cache kept
  whole is every layer's anyway; the policy's layer budgets are fixed before the pass, MaskKV's importance offline),
  and it takes it where that holds less (``DiffusionGemmaConfig.cuts_layer_by_layer``: the released model, not a
  shape whose hidden state is as wide as its full layers' entries together).

A prompt is encoded in chunks of ``ENCODER_CHUNK`` from its first position and again from its document's end
(``split``), or after a document prefix encoded before (``prefix``, a ``DocumentCache`` entry), so the answer is the
same whichever way, and whether its document was reused.

``CompressingForward`` answers a ``denoising_loop``'s requests over one prompt: at its first decode the prompt is
encoded and cut (``encode_and_cut`` where the policy cuts, else ``encode_whole`` and the first step), returning the
first step's exact logits; every later step decodes over the compressed cache, and a committed canvas joins it
through the encoder, uncompressed. ``generate_compressed`` drives the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from maskkv_cli.models.diffusion_gemma import DiffusionGemma, LayerKV, PromptCache
from maskkv_cli.models.diffusion_gemma_cache import with_room
from maskkv_cli.policies.base import Policy
from maskkv_cli.sampling.diffusion_gemma_kv import (
    Compression,
    EncodedPrompt,
    LayerChoice,
    WindowQueries,
    check_policy,
    encode_prompt,
    first_step_compressing,
    planned_budgets,
    select_full_layer,
)
from maskkv_cli.sampling.diffusion_gemma_steps import (
    CommitRequest,
    DecodeRequest,
    DiffusionGemmaSampling,
    denoising_loop,
    drive_loop,
)


def _check_prefix(ids: Tensor, prefix: EncodedPrompt | None) -> int:
    """Where the ids left to encode start (the prefix's length, or 0)."""
    if prefix is None:
        return 0
    start = prefix.cache.length
    if start > ids.shape[1] or prefix.cache.batch_size != ids.shape[0]:
        raise ValueError(f"a prefix of {start} positions does not start this {tuple(ids.shape)} prompt")
    return start


def prompt_chunks(model: DiffusionGemma, start: int, stop: int, split: int = 0) -> list[tuple[int, int]]:
    """The encoder's chunks of positions ``start .. stop - 1``: from ``start``, and again from ``split`` (a
    document's end) when it lies inside."""
    if start < split < stop:
        return model.encoder_chunks(start, split) + model.encoder_chunks(split, stop)
    return model.encoder_chunks(start, stop)


@torch.no_grad()
def encode_whole(model: DiffusionGemma, ids: Tensor, window: int, prefix: EncodedPrompt | None = None,
                 split: int = 0, spare: int = 0) -> EncodedPrompt:
    """The prompt ids (B, M) through the encoder chunk by chunk (``encode_prompt``): after ``prefix``, or in two
    parts at ``split``; the full layers keep ``spare`` slots of room."""
    if prefix is None and 0 < split < ids.shape[1]:
        prefix = encode_prompt(model, ids[:, :split], window)
    return encode_prompt(model, ids, window, prefix, spare=spare)


class LayerCut:
    """A ``LayerObserver`` for the first step's pass through full layer number ``j``: its votes cut the layer
    (``select_full_layer``), kept in ``kept`` and ``choice``."""

    def __init__(self, model: DiffusionGemma, encoded: EncodedPrompt, policy: Policy, j: int, budget: int) -> None:
        self.model, self.encoded, self.policy, self.j, self.budget = model, encoded, policy, j, budget
        self.kept: LayerKV | None = None
        self.choice: LayerChoice | None = None

    def __call__(self, _i: int, _x: Tensor, q: Tensor, keys: Tensor, _v: Tensor) -> None:
        self.kept, self.choice = select_full_layer(self.model, self.encoded, self.policy, self.j, self.budget, q,
                                                   keys)


@torch.no_grad()
def encode_and_cut(model: DiffusionGemma, ids: Tensor, canvas: Tensor, policy: Policy, budget: int,
                   prefix: EncodedPrompt | None = None, split: int = 0) -> tuple[Tensor, Compression]:
    """The prompt ids (B, M) encoded layer by layer, each full layer cut by the first step's votes before the next
    is encoded (see the module doc): the first step's raw logits (B, C, V) of ``canvas`` (no self-conditioning)
    and the compression, both equal to ``encode_whole`` then ``first_step_compressing``."""
    m = ids.shape[1]
    budgets = planned_budgets(model, m, policy, budget)
    if budgets is None:
        raise ValueError("nothing is cut at this budget: encode the prompt whole (encode_whole)")
    start = _check_prefix(ids, prefix)
    recent = WindowQueries(model, min(policy.options.window, m), prefix)
    layers = list((prefix.cache if prefix is not None else model.empty_cache(ids.shape[0])).layers)
    chunks = prompt_chunks(model, start, m, split)
    hidden = torch.empty(ids.shape[0], m - start, model.gemma.d_model, dtype=model.dtype, device=model.device)
    for a, z in chunks:  # the prompt's rows, each chunk's overwritten by its output layer after layer
        hidden[:, a - start : z - start] = model.embed(ids[:, a:z])
    full = model.gemma.full_layers
    x = model.decoder_input(canvas)  # (B, C, d): the first step's canvas, no self-conditioning
    canvas_ropes = model.rope(torch.arange(m, m + canvas.shape[1], device=canvas.device))
    choices: list[LayerChoice] = []
    for i, layer in enumerate(model.layers):
        # a full layer's store keeps room for the canvas, so that the first step does not copy the whole layer
        store = None if layer.spec.sliding else with_room(layers[i], m - start, canvas.shape[1])
        for a, z in chunks:
            rows = hidden[:, a - start : z - start]
            ropes = model.rope(torch.arange(a, z, device=ids.device))
            out, layers[i] = model.encode_layer(i, rows, ropes, layers[i], store, recent.observe)
            rows.copy_(out)
        if i in full:
            j = full.index(i)
            vote = LayerCut(model, EncodedPrompt(PromptCache(tuple(layers), m), recent.queries), policy, j,
                            budgets[j])
            x = model.decode_layer(i, x, layers[i], canvas_ropes, vote)  # over the whole layer: exact logits
            assert vote.kept is not None and vote.choice is not None
            layers[i] = vote.kept  # then cut, before the next layer is encoded
            choices.append(vote.choice)
            del vote  # it holds the whole layer (its view of the prompt): free it now
        else:
            x = model.decode_layer(i, x, layers[i], canvas_ropes)
    del hidden
    return model.head(x), Compression(PromptCache(tuple(layers), m), tuple(choices), tuple(budgets))


class CompressingForward:
    """Answers a loop's requests over one prompt's cache: the first decode encodes the prompt and votes (see the
    module doc), commits append uncompressed."""

    def __init__(self, model: DiffusionGemma, prompt_ids: Tensor, policy: Policy, budget: int,
                 encoded: EncodedPrompt | None = None, prefix: EncodedPrompt | None = None, split: int = 0,
                 spare: int = 0) -> None:
        """``encoded``: the prompt encoded already (``encode_prompt`` with the policy's window); else it is
        encoded at the first decode, after ``prefix`` (its leading ids encoded before) or in two parts at ``split``,
        layer by layer with the cut where the policy cuts, else whole with ``spare`` slots of room."""
        check_policy(policy)
        self.model, self.ids, self.policy, self.budget = model, prompt_ids, policy, budget
        self.encoded, self.prefix, self.split, self.spare = encoded, prefix, split, spare
        self.cache: PromptCache | None = None
        self.compression: Compression | None = None

    @torch.no_grad()
    def __call__(self, request: DecodeRequest | CommitRequest) -> Tensor | None:
        if self.compression is None:  # the first step of the first canvas: the votes
            if not isinstance(request, DecodeRequest) or request.self_conditioning is not None:
                raise ValueError("the votes come from the first canvas's first step (no self-conditioning)")
            logits, self.compression = self._first(request.canvas)
            self.cache, self.encoded, self.prefix = self.compression.cache, None, None
            return logits
        assert self.cache is not None
        if isinstance(request, CommitRequest):
            self.cache = self.model.commit(self.cache, request.tokens)
            return None
        return self.model.decode(request.canvas, self.cache, request.self_conditioning)

    def _first(self, canvas: Tensor) -> tuple[Tensor, Compression]:
        m, window = self.ids.shape[1], self.policy.options.window
        cuts = planned_budgets(self.model, m, self.policy, self.budget) is not None
        if self.encoded is None and cuts and self.model.gemma.cuts_layer_by_layer:
            return encode_and_cut(self.model, self.ids, canvas, self.policy, self.budget, self.prefix, self.split)
        spare = max(self.spare, canvas.shape[1])  # at least the first step's canvas: no copy of a whole layer
        encoded = self.encoded or encode_whole(self.model, self.ids, window, self.prefix, self.split, spare)
        return first_step_compressing(self.model, encoded, canvas, self.policy, self.budget)


@dataclass(frozen=True)
class CompressedOutput:
    sequences: Tensor
    decoder_passes: Tensor
    steps: tuple[int, ...]
    compression: Compression


@torch.no_grad()
def generate_compressed(model: DiffusionGemma, prompt_ids: Tensor, policy: Policy, budget: int,
                        settings: DiffusionGemmaSampling | None = None, generator: torch.Generator | None = None,
                        seed: int | None = None) -> CompressedOutput:
    """``generate_reference`` with the prompt cache compressed by ``policy`` at ``budget`` (see the module doc): the
    same random numbers in the same order, so ``full`` (or a budget at least the prompt) gives its tokens."""
    settings = settings or DiffusionGemmaSampling()
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    canvases = -(-settings.max_new_tokens // model.gemma.canvas_length)
    forward = CompressingForward(model, prompt_ids, policy, budget, spare=canvases * model.gemma.canvas_length)
    loop = denoising_loop(prompt_ids, model.gemma.vocab_size, model.gemma.canvas_length, model.dtype, settings,
                          generator)
    out = drive_loop(loop, forward)
    assert forward.compression is not None
    return CompressedOutput(out.sequences, out.decoder_passes, out.steps, forward.compression)


__all__ = ["CompressedOutput", "CompressingForward", "LayerCut", "encode_and_cut", "encode_whole",
           "generate_compressed", "prompt_chunks"]
