"""Which layout of a ragged per-head cache is faster for a response step: padded + -inf mask, or packed heads?

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_ragged_layout.py [--budget 256] [--device cpu] [--dtype fp32]
    .venv/bin/python scripts/bench_ragged_layout.py --device cuda --dtype bf16     # the engine's GPU dtype

Shapes of one llada-small layer (16 heads of 64) at a MaskKV step: L = 128 response queries attend to each
head's kept prompt entries plus the 128 response keys. Head lengths follow a prompt-preference split of
16 x budget (alpha 0.1, preferences drawn once with a fixed seed), so the longest head sets the padding.
(a) padded: one SDPA over (1, H, K_max + L, D) with an additive (1, H, 1, K_max + L) mask (the engine's layout);
(b) packed: heads stored back to back in one flat buffer with offsets (no padding), one SDPA call per head
(what a varlen kernel does in one launch; without such a kernel on the CPU it is a Python loop over heads).
Both compute the same result; the script checks that (within the dtype's rounding), then prints the median time of
each (after warm-up). ``--dtype`` (fp32, bf16, fp16) is the dtype of every query, key, value and mask tensor, so
that on a GPU the kernel timed is the one the engine's dtype gets.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from maskkv_cli.kv.budgets import preference_head_budgets

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# padded and packed sum in different orders: they agree to about the dtype's rounding of the outputs
TOLERANCE = {"fp32": (1e-4, 1e-5), "bf16": (2e-2, 2e-2), "fp16": (2e-3, 2e-3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                    help="dtype of every query, key, value and mask tensor (default fp32)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    dt = DTYPES[args.dtype]
    h, d, L = args.heads, args.head_dim, args.response
    pref = torch.rand(1, h) ** 2  # head preferences: only the split of the budget, not timed
    lengths = preference_head_budgets(args.budget, pref, 0.1)[0].tolist()
    kmax = max(lengths)
    q = torch.randn(1, h, L, d, device=dev, dtype=dt)
    keys = [torch.randn(n + L, d, device=dev, dtype=dt) for n in lengths]
    vals = [torch.randn(n + L, d, device=dev, dtype=dt) for n in lengths]
    # (a) padded
    kp = torch.zeros(1, h, kmax + L, d, device=dev, dtype=dt)
    vp = torch.zeros(1, h, kmax + L, d, device=dev, dtype=dt)
    bias = torch.zeros(1, h, 1, kmax + L, device=dev, dtype=dt)  # the mask in the compute dtype, as the engine
    for i, n in enumerate(lengths):
        kp[0, i, :n], kp[0, i, kmax:] = keys[i][:n], keys[i][n:]
        vp[0, i, :n], vp[0, i, kmax:] = vals[i][:n], vals[i][n:]
        bias[0, i, 0, n:kmax] = float("-inf")
    # (b) packed
    kf, vf = torch.cat(keys), torch.cat(vals)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n + L)

    def padded() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, kp, vp, attn_mask=bias)

    def packed() -> torch.Tensor:
        return torch.stack([F.scaled_dot_product_attention(q[0, i], kf[offsets[i]:offsets[i + 1]],
                                                           vf[offsets[i]:offsets[i + 1]]) for i in range(h)])[None]

    rtol, atol = TOLERANCE[args.dtype]
    torch.testing.assert_close(padded(), packed(), rtol=rtol, atol=atol)

    def median_ms(fn) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(args.repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    a, b = median_ms(padded), median_ms(packed)
    pad_share = 1 - (sum(lengths) + h * L) / (h * (kmax + L))
    print(f"{args.dtype} on {dev}: head lengths {min(lengths)}..{kmax} (sum {sum(lengths)}), padding "
          f"{pad_share:.0%} of the padded buffer")
    print(f"padded + mask: {a:.3f} ms   packed, per-head calls: {b:.3f} ms   packed / padded = {b / a:.2f}")


if __name__ == "__main__":
    main()
