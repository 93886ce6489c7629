"""MaskKV vs the baselines on DiffusionGemma's prompt cache, on a **tiny random** DiffusionGemma (not evidence
about the released checkpoint: the weights are random, the "prompts" random ids).

The model is the one of ``tests/test_diffusion_gemma_kv.py`` (3 sliding + 3 full layers, 2 KV heads of 32 dims on
the full layers, window 8, sharp random weights) with a canvas of 16. Each case: a random prompt of ``--prompt``
ids, the encoder's cache, the first step over the full cache on a random canvas (the votes), the compression at
budget B (entries per KV head per full layer, on average), then, against the full cache:

- ``step2``: the second step teacher-forced (the first step's renoised canvas and its tempered logits as
  self-conditioning, the same for every policy, as the first step runs over the full cache): the relative L2 error
  of the raw logits, and the share of canvas positions whose argmax agrees;
- ``fresh``: a first step on another random canvas (queries that did not vote): the same two numbers;
- ``kept``: the share of the step-2 canvas queries' prompt attention (over the full cache, per full layer and KV
  head, averaged) that lands on the entries the policy kept: the selection's quality before the layers above
  amplify the error (a random model amplifies it a lot: in one case 120 of 128 entries kept left a logit error of 0.24);
- ``tokens``: a whole generation of 2 canvases in the deterministic limit (t_min 0, t_max 1e-6, 8 steps), the
  share of the generated tokens equal to the full cache's (chaotic on a random model: a rough number).

MaskKV's layer importance comes from ``full_layer_importance`` averaged over ``--calibration`` other prompts.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/dgemma_kv_tiny.py
"""

from __future__ import annotations

import argparse
import statistics

import torch

from maskkv_cli.models.diffusion_gemma import DiffusionGemma, PromptCache
from maskkv_cli.models.diffusion_gemma_config import FULL, SLIDING, named_config
from maskkv_cli.policies import PolicyOptions, get_policy
from maskkv_cli.sampling.diffusion_gemma_forward import generate_compressed
from maskkv_cli.sampling.diffusion_gemma_kv import (
    Compression,
    compress,
    encode_prompt,
    first_step,
    full_layer_importance,
)
from maskkv_cli.sampling.diffusion_gemma_steps import (
    DiffusionGemmaSampling,
    generate_reference,
    random_canvas,
    step_on_logits,
)

POLICIES = ("maskkv", "mask-vote-uniform", "snapkv", "pyramidkv", "adakv", "streamingllm", "random")
V, C = 512, 16


def tiny_model() -> DiffusionGemma:
    cfg = named_config("diffusiongemma-tiny").with_(n_layers=6, layer_types=(SLIDING, FULL) * 3, n_global_kv_heads=2,
                                                    canvas_length=C)
    return DiffusionGemma(cfg).eval().init_spread_weights(0)


def kept_share(model: DiffusionGemma, cache: PromptCache, canvas: torch.Tensor, signal: torch.Tensor,
               comp: Compression) -> float:
    """Mean over full layers, KV heads of the share of the canvas queries' prompt attention (full cache) on the kept
    entries."""
    m, shares = cache.length, []
    chosen = {ch.layer: ch for ch in comp.choices}

    def observe(i: int, _x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, _v: torch.Tensor) -> None:
        if i not in chosen:
            return
        group = q.shape[1] // k.shape[1]
        probs = torch.softmax(q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2), dim=-1)
        mass = probs.sum(2)[..., :m].view(q.shape[0], k.shape[1], group, m).mean(2)  # (B, H_kv, M)
        ch = chosen[i]
        for h in range(k.shape[1]):
            kept = ch.positions[0, h, : int(ch.head_budgets[0, h])]
            shares.append(float(mass[0, h, kept].sum() / mass[0, h].sum()))

    model.decode(canvas, cache, signal, observe=observe)
    return statistics.fmean(shares)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def agree(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--budgets", default="4,8,16")
    parser.add_argument("--calibration", type=int, default=4)
    args = parser.parse_args()
    model = tiny_model()
    m = args.prompt
    ids_of = [torch.randint(3, V, (1, m), generator=torch.Generator().manual_seed(100 + i)) for i in range(args.cases)]
    calib = []
    for i in range(args.calibration):
        ids = torch.randint(3, V, (1, m), generator=torch.Generator().manual_seed(900 + i))
        canvas = random_canvas(1, C, V, torch.Generator().manual_seed(950 + i))
        calib.append(full_layer_importance(model, model.encode(ids).cache, canvas))
    importance = tuple(statistics.fmean(col) for col in zip(*calib, strict=True))
    print(f"tiny random DiffusionGemma, prompt {m}, canvas {C}, {args.cases} cases; "
          f"I(l) of the full layers: {', '.join(f'{x:.3f}' for x in importance)}")
    settings = DiffusionGemmaSampling(max_new_tokens=2 * C, t_min=0.0, t_max=1e-6, max_denoising_steps=8)
    step_settings = DiffusionGemmaSampling()
    refs = [generate_reference(model, ids, settings, seed=i) for i, ids in enumerate(ids_of)]
    print("| policy | B | kept | step2 rel. err | step2 argmax agree | fresh rel. err | fresh argmax agree | "
          "tokens agree |")
    print("|---|---|---|---|---|---|---|---|")
    for budget in (int(b) for b in args.budgets.split(",")):
        for name in POLICIES:
            policy = get_policy(name, PolicyOptions(importance=importance))
            rows: list[tuple[float, ...]] = []
            for i, ids in enumerate(ids_of):
                prompt = encode_prompt(model, ids)
                canvas = random_canvas(1, C, V, torch.Generator().manual_seed(i))
                raw, votes = first_step(model, prompt.cache, canvas)
                comp = compress(model, prompt, votes, policy, budget)
                first = step_on_logits(raw, canvas, canvas, None, step_settings.max_denoising_steps,
                                       torch.zeros(1, dtype=torch.bool), None, step_settings, V, model.dtype,
                                       torch.Generator().manual_seed(50 + i))
                full2 = model.decode(first.canvas, prompt.cache, first.logits)
                ours2 = model.decode(first.canvas, comp.cache, first.logits)
                fresh = random_canvas(1, C, V, torch.Generator().manual_seed(500 + i))
                full_f, ours_f = model.decode(fresh, prompt.cache), model.decode(fresh, comp.cache)
                out = generate_compressed(model, ids, policy, budget, settings, seed=i)
                tokens = float((out.sequences[:, m:] == refs[i].sequences[:, m:]).float().mean())
                kept = kept_share(model, prompt.cache, first.canvas, first.logits, comp)
                rows.append((kept, rel(ours2, full2), agree(ours2, full2), rel(ours_f, full_f), agree(ours_f, full_f),
                             tokens))
            means = [statistics.fmean(col) for col in zip(*rows, strict=True)]
            print(f"| {name} | {budget} | {means[0]:.2f} | {means[1]:.3f} | {means[2]:.2f} | {means[3]:.3f} | "
                  f"{means[4]:.2f} | {means[5]:.2f} |")


if __name__ == "__main__":
    main()
