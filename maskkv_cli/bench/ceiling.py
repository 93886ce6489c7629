"""The machine's own ceiling beside a ``bench speed`` row, so that "at the limit" is also stated against the
hardware and not only against the engine's bare forward (``bench/limit.py``).

- ``matmul_gflops``: dense matrix product throughput (``torch.mm`` of two n x n matrices) in the model's dtype,
  on the case's device, with the case's torch threads (on the CPU by default: one thread, fp32), measured in
  the case's own process right after its run, so the same background load applies to both.
- ``forward_flops``: the matrix-product FLOPs of one bare forward over ``[prompt ; masks]``, the work any
  prefill has to do: ``2 x T x`` the weights of every linear layer of the blocks (of a mixture of experts, the
  experts a token runs: ``top_k`` of them and the shared one), ``4 x T^2 x heads x head_dim`` per layer for
  ``Q K^T`` and ``A V``, and ``2 x L x d_model x vocab`` for the LM head on the response rows. Norms, RoPE,
  softmax, routers and MaskKV's scoring are not counted (small beside these at any length the bench runs).

The prefill's achieved GFLOP/s is ``forward_flops / prefill_s``; its ratio to ``matmul_gflops`` says how close the
prefill runs to what the hardware does on a plain matrix product.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

from maskkv_cli.models.moe import MoE
from maskkv_cli.runtime.stats import now

MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}  # large enough to run at full speed, small enough to take < 1 s
MATMUL_REPEATS = 7


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int | None = None,
                  repeats: int = MATMUL_REPEATS) -> tuple[float, int]:
    """(median GFLOP/s of ``repeats`` timed products after two warm-up products, the matrix size n)."""
    n = size or MATMUL_SIZE.get(device.type, MATMUL_SIZE["cpu"])
    gen = torch.Generator(device=device).manual_seed(0)  # drawn where they are used (8192^2 twice on a GPU)
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=out)
    seconds = []
    for _ in range(repeats):
        start = now(device)
        torch.mm(a, b, out=out)
        seconds.append(now(device) - start)
    return 2 * n**3 / statistics.median(seconds) / 1e9, n


def token_linear_weights(model: Any) -> float:
    """The linear layers' weights one token goes through, over every block: all of them, except that a mixture of
    experts' routed experts count ``top_k`` of ``n_experts`` (each token runs only the experts its router picks;
    the router and a shared expert run for every token)."""
    moe = model.config.moe
    share = 1.0 if moe is None else moe.top_k / moe.n_experts
    total = 0.0
    for block in model.blocks:
        routed = {id(p) for m in block.modules() if isinstance(m, MoE) for p in m.experts.parameters()}
        total += sum(m.weight.numel() * (share if id(m.weight) in routed else 1.0) for m in block.modules()
                     if isinstance(m, nn.Linear))
    return total


def forward_flops(model: nn.Module, prompt_len: int, response_len: int) -> float:
    """Matrix-product FLOPs of one bare forward over ``prompt_len + response_len`` tokens (module docstring)."""
    cfg = model.config  # type: ignore[attr-defined]
    t = prompt_len + response_len
    linear = token_linear_weights(model)
    attention = 4 * t * t * cfg.n_heads * cfg.head_dim * cfg.n_layers
    head = 2 * response_len * cfg.d_model * cfg.vocab_size
    return float(2 * t * linear + attention + head)


def ceiling_fields(model: nn.Module, device: torch.device, prompt_len: int, response_len: int,
                   prefill_s: float) -> dict[str, float | int | str]:
    """The row fields: ``prefill_flops``, ``prefill_gflops`` (achieved), ``matmul_gflops`` (the machine's),
    ``matmul_size`` and ``cpu_capability`` (the SIMD level torch dispatches to, e.g. AVX2 or AVX512)."""
    flops = forward_flops(model, prompt_len, response_len)
    gflops, n = matmul_gflops(device, next(model.parameters()).dtype)
    return {"prefill_flops": flops, "prefill_gflops": flops / prefill_s / 1e9 if prefill_s > 0 else 0.0,
            "matmul_gflops": gflops, "matmul_size": n, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
