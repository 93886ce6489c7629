"""Which layout of a ragged per-head cache is faster for a response step: padded + -inf mask, or packed heads?

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_ragged_layout.py [--budget 256] [--device cpu]

Shapes of one llada-small layer (16 heads of 64) at a MaskKV step: L = 128 response queries attend to each
head's kept prompt entries plus the 128 response keys. Head lengths follow a prompt-preference split of
16 x budget (alpha 0.1, preferences drawn once with a fixed seed), so the longest head sets the padding.
(a) padded: one SDPA over (1, H, K_max + L, D) with an additive (1, H, 1, K_max + L) mask (the engine's layout);
(b) packed: heads stored back to back in one flat buffer with offsets (no padding), one SDPA call per head
(what a varlen kernel does in one launch; without such a kernel on the CPU it is a Python loop over heads).
Both compute the same result; the script checks that, then prints the median time of each (after warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from maskkv_cli.kv.budgets import preference_head_budgets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    h, d, L = args.heads, args.head_dim, args.response
    pref = torch.rand(1, h) ** 2
    lengths = preference_head_budgets(args.budget, pref, 0.1)[0].tolist()
    kmax = max(lengths)
    q = torch.randn(1, h, L, d, device=dev)
    keys = [torch.randn(n + L, d, device=dev) for n in lengths]
    vals = [torch.randn(n + L, d, device=dev) for n in lengths]
    # (a) padded
    kp = torch.zeros(1, h, kmax + L, d, device=dev)
    vp = torch.zeros(1, h, kmax + L, d, device=dev)
    bias = torch.zeros(1, h, 1, kmax + L, device=dev)
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

    torch.testing.assert_close(padded(), packed(), rtol=1e-4, atol=1e-5)

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
    print(f"head lengths {min(lengths)}..{kmax} (sum {sum(lengths)}), padding {pad_share:.0%} of the padded buffer")
    print(f"padded + mask: {a:.3f} ms   packed, per-head calls: {b:.3f} ms   packed / padded = {b / a:.2f}")


if __name__ == "__main__":
    main()
