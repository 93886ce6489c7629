"""How far quantized weights move a model's outputs (issue 48): logits and greedy tokens against fp32 and bf16.

For each model (the embedded one, random weights of named shapes) and weight variant (``MODE`` or ``MODE@DTYPE``:
``int8`` loads in fp32, ``int4`` in bf16 on the CPU, ``dtype auto``), on the same random prompts:

- the forward's logits: argmax agreement and relative error ``||q - ref|| / ||ref||`` against the fp32 model and
  against the bf16 model (unquantized);
- greedy generation (full cache, one token per step): the share of generated tokens equal to the fp32 model's.

Random weights (``bench.cases.random_model``, std 0.02) give flat logits whose argmax is fragile: read their
agreement as a measure of numerical distance, not of answers. Prints one JSON row per (model, variant).

    python scripts/quant_agreement.py --models embedded,llada2-tiny,llada-small
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from maskkv_cli.bench.cases import random_model
from maskkv_cli.engine.plan import CacheConfig, plan_cache
from maskkv_cli.models.config import named_config
from maskkv_cli.models.loading import load_model
from maskkv_cli.models.quantize import quantize_model, weights_bytes
from maskkv_cli.sampling import GenerationConfig, sample

EMBEDDED = "maskkv_cli/assets/tiny-llada"


def build(name: str, variant: str) -> Any:
    """The model ``name`` with the weights ``variant`` (``none``, ``int8``, ``int4``, each ``@dtype`` or auto)."""
    mode, _, dtype = variant.partition("@")
    if name == "embedded":
        return load_model(EMBEDDED, dtype=dtype or None, quantize=mode)
    from maskkv_cli.models.loading import parse_dtype

    base = random_model(named_config(name), dtype=parse_dtype(dtype or None, "cpu", mode))
    return quantize_model(base, mode)


def prompts(cfg: Any, n: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, cfg.vocab_size, (n, length), generator=g)
    ids[ids == cfg.mask_token_id] = 6
    return ids


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(ids[i : i + 1]).float() for i in range(ids.shape[0])])


def generated(model: Any, ids: torch.Tensor, gen: GenerationConfig) -> torch.Tensor:
    out = []
    for i in range(ids.shape[0]):
        prompt = ids[i : i + 1]
        plan = plan_cache(model, CacheConfig("full"), prompt.shape[1], block_length=gen.block_length)
        out.append(sample(model, prompt, gen, plan).tokens)
    return torch.cat(out)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    return {"argmax_agreement": round((out.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
            "relative_logit_error": round(((out - ref).norm() / ref.norm()).item(), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="embedded,llada2-tiny,llada-small")
    ap.add_argument("--variants", default="none@bf16,int8,int8@bf16,int4,int4@fp32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    gen = GenerationConfig(gen_length=args.gen_length, steps=args.gen_length, block_length=args.gen_length)
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        ref_model = build(name, "none@fp32")
        ids = prompts(ref_model.config, args.prompts, args.length, args.seed)
        ref, ref_tokens = logits(ref_model, ids), generated(ref_model, ids, gen)
        ref_bytes = weights_bytes(ref_model)
        bf16 = build(name, "none@bf16")
        ref_bf16 = logits(bf16, ids)
        del ref_model, bf16
        for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
            model = build(name, variant)
            out = logits(model, ids)
            tokens = generated(model, ids, gen)
            print(json.dumps({"model": name, "variant": variant, "dtype": str(model.dtype).removeprefix("torch."),
                              "prompts": args.prompts, "length": args.length,
                              "vs_fp32": compare(out, ref), "vs_bf16": compare(out, ref_bf16),
                              "greedy_token_agreement_vs_fp32": round((tokens == ref_tokens).float().mean().item(), 4),
                              "weights_share_of_fp32": round(weights_bytes(model) / ref_bytes, 3)}), flush=True)
            del model


if __name__ == "__main__":
    main()
