"""Peak RSS and wall time of ``maskkv ask`` with and without the start-up allocator setting (issue #26).

Builds (once) a checkpoint of the llada-small shape with random weights in the upstream layout, using the bundled
tiny model's tokenizer and special ids (the embedding keeps llada-small's 126,464 rows, so the weights are the
real 1.40 GB), and a text document of about ``--tokens`` tokens made from the bundled corpus. Then runs
``maskkv ask`` in fresh processes, alternating the allocator settings of ``--settings`` (``SETTINGS``: the default,
fixed thresholds of 4 MiB and 8 MiB; ``fixed-128k``, the mmap threshold fixed at 128 KiB as before 2026-12-06;
``glibc``, ``MASKKV_MALLOC=default``), ``--repeats`` times each, and prints every run and the medians. The peak
RSS and the CPU time (user + system) of each child come from ``os.wait4`` (the kernel's figures for that process
alone); on a shared machine the CPU time is the steadier of the two clocks.

    python scripts/bench_ask_allocator.py --work /tmp/ask-alloc --tokens 16384 --repeats 5
    python scripts/bench_ask_allocator.py --tokens 4096 --repeats 3 --settings default,fixed-128k,glibc
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "maskkv_cli" / "assets"
# name -> the environment that selects it (glibc reads its MALLOC_ variables at start-up; maskkv leaves a threshold
# set that way alone, runtime/allocator.py)
SETTINGS = {"default": {}, "fixed-128k": {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"},
            "glibc": {"MASKKV_MALLOC": "default"}}


def paths(work: Path, tokens: int) -> tuple[Path, Path]:
    """The checkpoint folder and the document ``build`` writes."""
    return work / "llada-small-random", work / f"doc-{tokens}.txt"


def build(work: Path, tokens: int) -> None:
    """Write the checkpoint and the document of ``paths`` where they are missing."""
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.llada import LLaDA
    from maskkv_cli.models.loading import read_config, save_model
    from maskkv_cli.prompting import load_tokenizer

    ckpt, doc = paths(work, tokens)
    tok = load_tokenizer(ASSETS / "tiny-llada")
    if not ckpt.is_dir():
        tiny = read_config(ASSETS / "tiny-llada")
        cfg = named_config("llada-small").with_(
            vocab_size=tiny.vocab_size, embedding_size=126464, max_sequence_length=tokens + 1024,
            mask_token_id=tiny.mask_token_id, eos_token_id=tiny.eos_token_id, pad_token_id=tiny.pad_token_id,
            bos_token_id=tiny.bos_token_id, eot_token_id=tiny.eot_token_id)
        save_model(LLaDA(cfg).init_weights(seed=0), ckpt, tok)
    if not doc.is_file():
        corpus = "\n\n".join(p.read_text() for p in sorted((ASSETS / "corpus").glob("*.txt")))
        per_copy = len(tok(corpus)["input_ids"])
        text = "\n\n".join([corpus] * (tokens // per_copy + 1))
        ids = tok(text)["input_ids"][:tokens]
        doc.write_text(tok.decode(ids))


def run_once(ckpt: Path, doc: Path, setting: str, extra: list[str]) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "MASKKV_MALLOC" and not k.startswith("MALLOC_")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(SETTINGS[setting])
    cmd = [sys.executable, "-m", "maskkv_cli", "ask", str(doc), "What is the special magic number?", "--model",
           str(ckpt), "--device", "cpu", "--json", "--quiet", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"maskkv ask failed:\n{err[-2000:]}")
    answer = json.loads(out)["answers"][0]
    return {"peak_rss_mib": usage.ru_maxrss / 1024, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "prefill_s": answer["stats"]["prefill_s"],
            "prompt_tokens": answer["prompt_tokens"], "answer": answer["answer"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ask-alloc"))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--settings", default="default,glibc", help=f"comma-separated, from: {', '.join(SETTINGS)}")
    ap.add_argument("extra", nargs="*", help="more arguments for maskkv ask (after --)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.build_only:
        build(args.work, args.tokens)
        return
    ckpt, doc = paths(args.work, args.tokens)
    if not (ckpt.is_dir() and doc.is_file()):
        # built in a child of its own: a process started by fork and exec keeps its parent's resident set as its
        # peak (``ru_maxrss``), so runs forked from a process that had held the model would all read at least its size
        subprocess.run([sys.executable, __file__, "--build-only", "--work", str(args.work), "--tokens",
                        str(args.tokens)], check=True)
    names = [n.strip() for n in args.settings.split(",")]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        ap.error(f"unknown setting {unknown[0]!r}; choose from {', '.join(SETTINGS)}")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for i in range(args.repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            r = run_once(ckpt, doc, name, args.extra)
            runs[name].append(r)
            print(f"run {i + 1} {name:11s} prompt {r['prompt_tokens']} tokens  peak RSS {r['peak_rss_mib']:8.1f} "
                  f"MiB  prefill {r['prefill_s']:7.1f} s  wall {r['wall_s']:7.1f} s  CPU {r['cpu_s']:7.1f} s",
                  flush=True)
    keys = ("peak_rss_mib", "prefill_s", "wall_s", "cpu_s")
    med = {n: {k: statistics.median(r[k] for r in runs[n]) for k in keys} for n in names}
    first = med[names[0]]
    for name, m in med.items():
        print(f"median {name:11s} peak RSS {m['peak_rss_mib']:.1f} MiB (spread "
              f"{max(r['peak_rss_mib'] for r in runs[name]) - min(r['peak_rss_mib'] for r in runs[name]):.1f}), "
              f"prefill {m['prefill_s']:.1f} s, wall {m['wall_s']:.1f} s, CPU {m['cpu_s']:.1f} s; {names[0]} / this: "
              f"peak RSS {first['peak_rss_mib'] - m['peak_rss_mib']:+.1f} MiB, prefill "
              f"{first['prefill_s'] / m['prefill_s']:.3f}, CPU {first['cpu_s'] / m['cpu_s']:.3f}")
    same = {r["answer"] for n in names for r in runs[n]}
    print(f"identical answers in every run: {len(same) == 1}")


if __name__ == "__main__":
    main()
