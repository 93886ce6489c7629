"""The memory model of ``maskkv plan`` against DiffusionGemma's measured peaks, phase by phase.

A random-weight DiffusionGemma with the released layer widths (``diffusiongemma-26b-a4b``) cut to ``--layers``
layers (the released pattern: five sliding, then one full; 6 layers hold about 5.5 B parameters, 11 GB in bf16), a
random prompt of each ``--contexts`` length minus one canvas, then what ``sampling/diffusion_gemma_forward.py`` runs:

- **encode whole**: the prompt through the encoder chunk by chunk (``encode_prompt``: chunks of ``ENCODER_CHUNK``
  tokens, the full layers' entries written in place, the attention masked in bounded blocks), its full layers with
  room for the canvas; then **first step**: the first denoising step over the whole cache, MaskKV's votes cutting
  each full layer at ``--budget`` (``first_step_compressing``; ``--budget 0``: the full cache, nothing cut);
- **layer by layer** (``--budget`` above 0: what the sampler runs when the first step cuts): ``encode_and_cut``,
  every chunk through one layer, the first step's pass through that layer cutting it before the next is encoded;
- **step**: a later step over the kept cache, with the first step's logits as self-conditioning.

Per phase: the peak above the weights (CUDA: ``max_memory_allocated``; CPU: live tensor bytes, which do not see a
kernel's own scratch), next to the memory model's figures for the same shape (``engine/batch_memory.py``). On CUDA
the attention folds each KV head's query heads into its rows so that the memory-efficient kernel runs (it takes the
masks and the full layers' 512-dim heads); the model counts no score matrix, which the CUDA run checks. For the
lead to run on a GPU (no GPU was lent to the task that wrote it):

    PYTHONPATH=. .venv/bin/python scripts/dgemma_memory_check.py --device cuda --contexts 8k,32k,128k

Smoke test on the CPU (a small shape): ``--tiny --device cpu --contexts 1k``.
"""

from __future__ import annotations

import argparse
import json

import torch

from maskkv_cli.bench.live_bytes import LiveBytes
from maskkv_cli.cli.parsing import parse_counts
from maskkv_cli.engine.batch_memory import batch_memory, config_geometry
from maskkv_cli.models.diffusion_gemma import DiffusionGemma
from maskkv_cli.models.diffusion_gemma_config import FULL, SLIDING, DiffusionGemmaConfig, named_config
from maskkv_cli.models.meta import meta_device
from maskkv_cli.models.quantize import weights_bytes
from maskkv_cli.policies import get_policy
from maskkv_cli.runtime.stats import read_current, read_peak, reset_peak
from maskkv_cli.sampling.diffusion_gemma_forward import encode_and_cut
from maskkv_cli.sampling.diffusion_gemma_kv import encode_prompt, first_step_compressing


def shape(layers: int, tiny: bool) -> DiffusionGemmaConfig:
    types = tuple(SLIDING if (i + 1) % 6 and i != layers - 1 else FULL for i in range(layers))
    if tiny:
        return named_config("diffusiongemma-tiny").with_(
            d_model=256, mlp_hidden_size=192, n_layers=layers, n_heads=8, n_kv_heads=4, head_dim=32, layer_types=types,
            n_experts=8, top_k_experts=4, moe_hidden_size=64, global_head_dim=64, n_global_kv_heads=2,
            sliding_window=64, vocab_size=4096, canvas_length=32, max_position_embeddings=1 << 20)
    return named_config("diffusiongemma-26b-a4b").with_(n_layers=layers, layer_types=types,
                                                        max_position_embeddings=1 << 20)


def random_weights(cfg: DiffusionGemmaConfig, device: torch.device, dtype: torch.dtype) -> DiffusionGemma:
    with meta_device():
        model = DiffusionGemma(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for buf in model.buffers():
            buf.fill_(1.0)
    return model.eval()


class Peak:
    """Peak bytes above what was held at entry: the CUDA allocator's, or live tensor bytes on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.live, self.value = device, None if device.type == "cuda" else LiveBytes(), 0

    def __enter__(self) -> Peak:
        if self.live is not None:
            self.live.__enter__()
        else:
            torch.cuda.synchronize(self.device)
            self.start = read_current(self.device)
            reset_peak(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
            self.value = self.live.peak
        else:
            torch.cuda.synchronize(self.device)
            self.value = read_peak(self.device) - self.start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--contexts", default="8k,32k")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a small shape (d 256) instead of the released widths")
    args = parser.parse_args()
    dev, dtype = torch.device(args.device), torch.bfloat16
    cfg = shape(args.layers, args.tiny)
    model = random_weights(cfg, dev, dtype)
    weights = weights_bytes(model)
    c = cfg.canvas_length
    policy = get_policy("maskkv" if args.budget else "full")
    for context in parse_counts(args.contexts, "--contexts"):
        m = context - c
        ids = torch.randint(3, cfg.vocab_size, (1, m), device=dev)
        canvas = torch.randint(3, cfg.vocab_size, (1, c), device=dev)
        with torch.no_grad():
            with Peak(dev) as encoding:
                prompt = encode_prompt(model, ids, spare=c)
            full_bytes = sum(kv.keys.nbytes + kv.values.nbytes for kv in prompt.cache.layers)
            with Peak(dev) as first:
                logits, compression = first_step_compressing(model, prompt, canvas, policy, args.budget or m)
            del prompt, compression
            layered = None
            if args.budget:
                with Peak(dev) as layered:
                    logits, compression = encode_and_cut(model, ids, canvas, policy, args.budget)
            else:
                compression = first_step_compressing(model, encode_prompt(model, ids, spare=c), canvas, policy, m)[1]
            kept = compression.cache
            with Peak(dev) as step:
                model.decode(canvas, kept, logits)
        kept_bytes = sum(kv.keys.nbytes + kv.values.nbytes for kv in kept.layers)
        memory = batch_memory(config_geometry(cfg), m, c, args.budget or m, 2)
        print(json.dumps({
            "context": context, "device": str(dev), "weights_bytes": weights, "full_cache_bytes": full_bytes,
            "kept_cache_bytes": kept_bytes,
            "measured": {"encode_whole_peak_above_start": encoding.value,
                         "first_step_peak_above_whole_cache": first.value,
                         "layer_by_layer_peak_above_start": None if layered is None else layered.value,
                         "step_peak_above_kept_cache": step.value},
            "model": {"cache_kept": memory.cache_per_sequence, "prefill_peak": memory.prefill_peak,
                      "one_full_layer_before_its_cut": memory.terms["full cache before the cut"],
                      "prompt_hidden_states": memory.terms["prompt hidden states"],
                      "encoder_chunk": memory.terms["encoder chunk"],
                      "encoder_mask_block": memory.terms["encoder mask block"],
                      "first_step_votes": memory.terms["first step votes"], "step": memory.step_per_sequence,
                      "peak_above_weights": memory.total(1)}}))


if __name__ == "__main__":
    main()
