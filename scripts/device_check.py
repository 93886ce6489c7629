"""The checks a lent GPU is for, in one short run: what the CPU tests pin, measured on the device.

Every claim below is tested bit for bit on the CPU; on CUDA other kernels run (cuBLAS, SDPA's flash and
memory-efficient kernels, torchao's CUDA products), so the same claims are measured there, not assumed. Each check
writes its figures into ``--out`` (JSON, rewritten after every check, so a run cut short keeps what finished) and
prints one line; a check that fails records its error and the next one runs, and within a check each case
(family, dtype, mode) that fails records its own error beside the others' rows.

- ``attention``: ``models.base.attention``'s folded grouped heads (the CUDA path) and SDPA's grouped heads against
  the plain definition in fp32, for the mask layouts the engine passes (max abs difference), and the SDPA kernel
  PyTorch picks for each (flash, efficient, cudnn or math: the math one forms every head's scores).
- ``block_contract``: per family and dtype, the cached step 0 (policy ``full``) and a cached step against the plain
  forward (equal bit for bit? max difference).
- ``alone_vs_batch``: per family and dtype, 8 prompts of other lengths and every kind of cache plan, in one batch
  and each alone: how many get the same tokens and the same probabilities.
- ``step_modes``: eager, ``compile`` and (CUDA) ``cuda-graph`` later steps of LLaDA, Dream and LLaDA-MoE: the same
  tokens? (LLaDA-MoE refuses the CUDA graph: its row records that.)
- ``quantized``: int8 and int4 weights (where torchao runs them on this device): tokens against the unquantized
  model's.
- ``diffusion_gemma``: a tiny random DiffusionGemma in transformers and loaded by maskkv: encoder and decoder
  logits (max difference) and greedy ``generate`` tokens in the deterministic limit.
- ``speed_smoke``: ``maskkv bench speed`` on the tiny shape with eager and (CUDA) CUDA-graph steps, one process.

    python scripts/device_check.py --device cuda --out runs/device-check.json     # about 2-4 minutes on a GPU
    OMP_NUM_THREADS=1 python scripts/device_check.py --device cpu --skip speed_smoke  # the same checks here
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # dgemma_folder's randomise

from maskkv_cli.bench.cases import random_model  # noqa: E402
from maskkv_cli.engine.plan import CacheConfig, plan_cache  # noqa: E402
from maskkv_cli.engine.prefill import prefill  # noqa: E402
from maskkv_cli.engine.step import plain_logits, response_logits  # noqa: E402
from maskkv_cli.engine.step_runner import StepOptions  # noqa: E402
from maskkv_cli.models.base import attention  # noqa: E402
from maskkv_cli.models.config import named_config  # noqa: E402
from maskkv_cli.policies import get_policy  # noqa: E402
from maskkv_cli.sampling import GenerationConfig, sample  # noqa: E402
from maskkv_cli.sampling.llada import generate  # noqa: E402
from maskkv_cli.sampling.stream import BatchJob, sample_many  # noqa: E402

FAMILIES = ("tiny", "dream-tiny", "llada-moe-tiny", "llada2-tiny")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _each(out: dict[str, Any], key: str, run: Callable[[], dict[str, Any]]) -> None:
    """``out[key] = run()``, or the error it raised in one line: one failing case (a family, a dtype, a mode) does
    not lose the others' rows."""
    try:
        out[key] = run()
    except Exception as exc:  # noqa: BLE001 - a failed case is a finding; the others still run
        lines = str(exc).strip().splitlines()
        out[key] = {"error": f"{type(exc).__name__}: {lines[0] if lines else ''}"}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def check_attention(dev: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    b, h, hkv, r, s, d = 2, 8, 2, 24, 300, 64
    q, k, v = (torch.randn(b, n, t, d, generator=g) for n, t in ((h, r), (hkv, s), (hkv, s)))
    keep = torch.rand(b, hkv, r, s, generator=g) > 0.3
    keep[..., 0] = True
    bias = torch.zeros(b, h, 1, s).masked_fill(torch.rand(b, h, 1, s, generator=g) > 0.7, float("-inf"))
    bias[..., 0] = 0.0
    out: dict[str, Any] = {}
    for name, mask in (("none", None), ("per KV head rows (bool)", keep), ("per query head (bias)", bias)):
        full = mask if mask is None or mask.shape[1] == h else mask.repeat_interleave(h // hkv, dim=1)
        reference = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), attn_mask=full)
        for dtype_name, dtype in DTYPES.items():
            args = [t.to(dev, dtype) for t in (q, k, v)]
            m = None if mask is None else (mask.to(dev) if mask.dtype == torch.bool else mask.to(dev, dtype))
            for fold in (False, True):
                got = attention(*args, m, fold=fold).cpu()
                label = f"{name}, {dtype_name}, {'folded' if fold else 'grouped'}"
                out[label] = {"max_diff": _diff(got, reference), "kernel": _kernel(*args, m, fold)}
    return out


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, fold: bool) -> str:
    """The SDPA kernel PyTorch picks for ``attention``'s call (grouped heads, or folded as on CUDA)."""
    backends = torch.nn.attention.SDPBackend
    names = {int(getattr(backends, n)): n.lower() for n in dir(backends) if n.isupper()}
    g = q.shape[1] // k.shape[1]
    if not fold:
        full = mask if mask is None or mask.shape[1] == q.shape[1] else mask.repeat_interleave(g, dim=1)
        return names.get(int(torch._fused_sdp_choice(q, k, v, full, 0.0, False, enable_gqa=True)), "?")
    b, h, r, d = q.shape
    folded = q.reshape(b, k.shape[1], g * r, d)
    if mask is not None:  # the folded layout's mask shape (models.base.attention lays it out the same way)
        mask = torch.zeros(b, k.shape[1], g * r, k.shape[2], dtype=q.dtype, device=q.device)
    return names.get(int(torch._fused_sdp_choice(folded, k, v, mask, 0.0, False)), "?")


def check_block_contract(dev: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    m, n = 40, 16
    for family in FAMILIES:
        if family == "llada2-tiny":
            continue  # block-causal: its contract is the block edges (tests/test_block_contract.py)
        for dtype_name, dtype in DTYPES.items():
            _each(out, f"{family} {dtype_name}", lambda family=family, dtype=dtype: _contract(dev, family, dtype, m, n))
    return out


def _contract(dev: torch.device, family: str, dtype: torch.dtype, m: int, n: int) -> dict[str, Any]:
    model = random_model(named_config(family), device=dev, dtype=dtype, std=0.2)
    shift = model.config.logit_shift
    split = m - shift
    rows = torch.arange(split, split + n, device=dev)
    equal, worst = 0, 0.0
    with torch.no_grad():
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            prompt = torch.randint(10, model.config.vocab_size, (1, m), generator=g)
            x = torch.cat([prompt, torch.full((1, n), model.config.mask_token_id)], 1).to(dev)
            cached, cache, _ = prefill(model, x, split, get_policy("full"), None, rows)
            plain = plain_logits(model, x, rows)
            step = response_logits(model, cache, x[:, split:], rows - split)
            equal += int(torch.equal(cached, plain)) + int(torch.equal(step, plain))
            worst = max(worst, _diff(cached, plain), _diff(step, plain))
    return {"bit_equal": f"{equal}/8", "max_diff": worst}


def check_alone_vs_batch(dev: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gen = GenerationConfig(gen_length=16, steps=16, block_length=8)
    kinds = [CacheConfig("maskkv", 16), CacheConfig("full"), CacheConfig("none"),
             CacheConfig("maskkv", 16, layer_budgets="online")]
    for family in FAMILIES:
        for dtype_name, dtype in DTYPES.items():
            _each(out, f"{family} {dtype_name}",
                  lambda family=family, dtype=dtype: _alone_vs_batch(dev, family, dtype, gen, kinds))
    return out


def _alone_vs_batch(dev: torch.device, family: str, dtype: torch.dtype, gen: GenerationConfig,
                    kinds: list[CacheConfig]) -> dict[str, Any]:
    model = random_model(named_config(family), device=dev, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size - 100
    prompts = [torch.randint(6, vocab, (1, n), generator=g).to(dev) for n in (40, 57, 63, 75, 90, 101, 33, 48)]
    jobs = [BatchJob(p, gen, plan_cache(model, kinds[i % len(kinds)], p.shape[1], block_length=gen.block_length))
            for i, p in enumerate(prompts)]
    tokens = probs = 0
    for job, together in zip(jobs, sample_many(model, jobs, 8), strict=True):
        alone = sample(model, job.prompt, gen, job.plan)
        tokens += int(torch.equal(together.tokens, alone.tokens))
        assert together.token_probs is not None and alone.token_probs is not None
        probs += int(torch.equal(together.token_probs.nan_to_num(-1.0), alone.token_probs.nan_to_num(-1.0)))
    return {"tokens_equal": f"{tokens}/8", "probs_equal": f"{probs}/8"}


def check_step_modes(dev: torch.device) -> dict[str, Any]:
    """Per family with a bidirectional cache (multi-head LLaDA, grouped-head Dream, LLaDA-MoE, which refuses the
    CUDA graph) and step mode: the eager mode's tokens?"""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = GenerationConfig(gen_length=32, steps=32, block_length=8)
    modes = ["eager", "compile"] + (["cuda-graph", "compile+cuda-graph"] if dev.type == "cuda" else [])
    out: dict[str, Any] = {}
    for family in ("tiny", "dream-tiny", "llada-moe-tiny"):
        model = random_model(named_config(family), device=dev, dtype=dtype, std=0.2)
        prompt = torch.randint(6, model.config.vocab_size - 100, (1, 64),
                               generator=torch.Generator().manual_seed(0)).to(dev)
        eager: list[torch.Tensor] = []

        def run(mode: str, model: Any = model, prompt: torch.Tensor = prompt,
                eager: list[torch.Tensor] = eager) -> dict[str, Any]:
            result = generate(model, prompt, gen, get_policy("maskkv"), 16, step_options=StepOptions.from_label(mode))
            if not eager:
                eager.append(result.tokens)
            steps = sorted(result.stats.step_s)
            return {"same_tokens_as_eager": bool(torch.equal(result.tokens, eager[0])),
                    "setup_s": round(result.stats.setup_s, 2),
                    "median_step_ms": round(1000 * steps[len(steps) // 2], 3)}

        for mode in modes:
            _each(out, f"{family} {mode}", lambda mode=mode, run=run: run(mode))
    return out


def check_quantized(dev: torch.device) -> dict[str, Any]:
    from maskkv_cli.models.quantize import QuantizeError, quantize_model

    gen = GenerationConfig(gen_length=32, steps=32, block_length=8)
    out: dict[str, Any] = {}
    for family in ("tiny", "llada2-tiny"):
        for dtype_name, dtype in DTYPES.items():
            base = random_model(named_config(family), device=dev, dtype=dtype, std=0.2)
            prompt = torch.randint(6, base.config.vocab_size - 100, (1, 48),
                                   generator=torch.Generator().manual_seed(1)).to(dev)
            plan = plan_cache(base, CacheConfig("maskkv", 16), 48, block_length=gen.block_length)
            reference = sample(base, prompt, gen, plan).tokens
            for mode in ("int8", "int4"):
                model = random_model(named_config(family), device=dev, dtype=dtype, std=0.2)
                try:
                    quantize_model(model, mode)
                except QuantizeError as exc:
                    out[f"{family} {dtype_name} {mode}"] = f"refused: {exc}"
                    continue
                tokens = sample(model, prompt, gen, plan).tokens
                same = float((tokens == reference).float().mean())
                out[f"{family} {dtype_name} {mode}"] = {"tokens_equal_unquantized": round(same, 3)}
    return out


def check_diffusion_gemma(dev: torch.device) -> dict[str, Any]:
    from dgemma_folder import randomise
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from maskkv_cli.models.loading import load_diffusion_gemma
    from maskkv_cli.sampling.diffusion_gemma_steps import DiffusionGemmaSampling, generate_reference

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, num_experts=4,
                top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=1024)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    ref = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, vision_config=vision,
                                                               canvas_length=8)).eval()
    randomise(ref, 0)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        ref = ref.to(dev)
        ours = load_diffusion_gemma(tmp, device=dev, dtype="float32")
    deterministic = dict(t_min=0.0, t_max=1e-6, max_denoising_steps=16)
    for seed in (0, 1):
        ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(10 + seed)).to(dev)
        torch.manual_seed(seed)
        with torch.no_grad():
            theirs = ref.generate(ids, max_new_tokens=24, **deterministic).sequences
        mine = generate_reference(ours, ids, DiffusionGemmaSampling(max_new_tokens=24, **deterministic), seed=seed)
        out[f"greedy generate, seed {seed}"] = {
            "tokens_equal": float((mine.sequences.to(theirs.device) == theirs).float().mean())}
    return out


def check_speed_smoke(dev: torch.device) -> dict[str, Any]:
    modes = "eager,cuda-graph" if dev.type == "cuda" else "eager"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "maskkv_cli", "bench", "speed", "--device", dev.type, "--config", "tiny",
               "--prompt-lengths", "64", "--gen-length", "32", "--steps", "32", "--block-length", "8", "--budgets",
               "8", "--step-modes", modes, "--in-process", "--no-limit", "--out", tmp, "--json"]
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return {"exit": proc.returncode, "seconds": round(time.perf_counter() - started, 1),
                "stdout_tail": proc.stdout[-1500:], "stderr_tail": proc.stderr[-1500:]}


CHECKS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "attention": check_attention, "block_contract": check_block_contract, "alone_vs_batch": check_alone_vs_batch,
    "step_modes": check_step_modes, "quantized": check_quantized, "diffusion_gemma": check_diffusion_gemma,
    "speed_smoke": check_speed_smoke,
}


def machine(dev: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(dev)}
    if dev.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(dev), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("runs/device-check.json"))
    parser.add_argument("--only", default="", help="comma-separated checks to run (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated checks to leave out")
    args = parser.parse_args()
    dev = torch.device(args.device)
    chosen = [c for c in (args.only.split(",") if args.only else CHECKS) if c and c not in args.skip.split(",")]
    report: dict[str, Any] = {"machine": machine(dev), "checks": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        started = time.perf_counter()
        try:
            with torch.no_grad():
                result: Any = CHECKS[name](dev)
        except Exception as exc:  # noqa: BLE001 - a failed check is a finding; the others still run
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        report["checks"][name] = {"seconds": round(time.perf_counter() - started, 1), "result": result}
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(args.out)
        print(f"{name} ({report['checks'][name]['seconds']} s): {json.dumps(result)[:600]}", flush=True)


if __name__ == "__main__":
    main()
