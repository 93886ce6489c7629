"""Whether one attention call over several sequences of one length gives each sequence the numbers of its call alone.

The engine runs each lane's attention in its own call (``engine/prefill.py``, ``engine/step.py``), so that a
sequence's numbers do not depend on the others in its batch. This checks what sharing one call would do: for each
head size, length and count of sequences, SDPA over ``count`` sequences laid out as the engine's joined queries,
keys and values (row by row, one sequence after the other; the call takes views of them) against each sequence's
own call (its keys and values copied out, as a lane's are). Reported per head size: the comparisons, how many
differed in any bit, and at which lengths. On this project's hosts (AMD EPYC, torch 2.13, fp32, 2026-12-07) at
two threads: 96 of 2,057 differed at head size 8 (odd lengths 21-31), none at 16 and 32; none at one thread.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/sdpa_grouping.py
    OMP_NUM_THREADS=1 .venv/bin/python scripts/sdpa_grouping.py --head-sizes 8,16 --heads 8
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def differing(heads: int, head_size: int, lengths: range, counts: tuple[int, ...]) -> tuple[int, int, list[int]]:
    """(comparisons, how many differed, the lengths at which any did) for one head size."""
    g = torch.Generator().manual_seed(0)
    compared, differ, where = 0, 0, set()
    for t in lengths:
        for count in counts:
            q, k, v = (torch.randn(1, count * t, heads, head_size, generator=g).transpose(1, 2) for _ in range(3))

            def shared(x: torch.Tensor, count: int = count, t: int = t) -> torch.Tensor:
                return x[0].unflatten(1, (count, t)).transpose(0, 1)  # (count, heads, t, head_size), a view

            together = F.scaled_dot_product_attention(shared(q), shared(k), shared(v))
            for i in range(count):
                rows = slice(i * t, (i + 1) * t)
                alone = F.scaled_dot_product_attention(q[:, :, rows], k[:, :, rows].contiguous(),
                                                       v[:, :, rows].contiguous())
                compared += 1
                if not torch.equal(together[i : i + 1], alone):
                    differ += 1
                    where.add(t)
    return compared, differ, sorted(where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-sizes", default="8,16,32", help="comma-separated (default 8,16,32)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--lengths", default="20-140", help="a range of sequence lengths, both ends included")
    args = parser.parse_args()
    low, high = (int(n) for n in args.lengths.split("-"))
    report: dict[str, object] = {"threads": torch.get_num_threads(), "heads": args.heads, "lengths": args.lengths}
    for size in (int(s) for s in args.head_sizes.split(",")):
        compared, differ, where = differing(args.heads, size, range(low, high + 1), (2, 3, 4, 8))
        report[f"head size {size}"] = {"compared": compared, "differed": differ, "at lengths": where}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
