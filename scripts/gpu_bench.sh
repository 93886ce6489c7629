#!/usr/bin/env bash
# Speed sweep for a short lent window on one H200 (or any CUDA GPU with >= 80 GB):
# the real LLaDA-8B shape with random bf16 weights (weights do not change speed), gen length 256 (256 steps,
# blocks of 32), none vs full vs MaskKV, each case in a fresh process, the limit line per case, results folder +
# Rich table. By default prompts 1k and 32k and MaskKV at budget 256 only (6 cases), the 32k cases first, so that
# the paper's 32k anchor is measured even if the window closes early.
#
#   scripts/gpu_bench.sh                      # 6 cases (32k first) into runs/bench-speed-h200
#   LENGTHS=1k,2k,4k,8k,16k,32k BUDGETS=64,256,1024 scripts/gpu_bench.sh
#                                             # the full sweep (30 cases): only with a long window
#   scripts/gpu_bench.sh --no-limit --json    # extra options go to `maskkv bench speed`
#   scripts/gpu_bench.sh --case-timeout 600   # a case is killed after 300 s unless told otherwise
#   STEP_MODES=eager,cuda-graph LENGTHS=32k BUDGETS=256 MASKKV_BENCH_OUT=runs/bench-steps-h200 scripts/gpu_bench.sh
#                                             # eager steps vs one CUDA graph per step, same run
#
# Finished rows are written after every case; if the window closes mid-sweep, run the same command again and
# the finished cases are reused (same results folder, same settings). A case that fails or runs past its
# timeout leaves an error row and the sweep goes on; its stderr is in <results folder>/logs/<key>.txt, and the
# command then exits 1 (a rerun runs the failed cases again). Expect roughly 20-40 s per case (process start,
# 16 GB of weights, a short warm-up and one prefill at the case's own length, run, limit; an estimate, not
# measured yet), so a few minutes for the default; `none` is timed for 3 steps and extrapolated.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
# MASKKV_BENCH_OUT, not OUT: a generic name another tool may already have exported would redirect the results
MASKKV_BENCH_OUT="${MASKKV_BENCH_OUT:-runs/bench-speed-h200}"
LENGTHS="${LENGTHS:-1k,32k}"
BUDGETS="${BUDGETS:-256}"
STEP_MODES="${STEP_MODES:-eager}"

"$PY" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_bench.sh: no CUDA device visible to torch")
p = torch.cuda.get_device_properties(0)
print(f"gpu: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}", file=sys.stderr)
PY

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m maskkv_cli bench speed \
  --device cuda --config llada-8b --dtype bf16 \
  --prompt-lengths "$LENGTHS" \
  --gen-length 256 --steps 256 --block-length 32 \
  --policies none,full,maskkv --budgets "$BUDGETS" \
  --none-steps 3 --threads 1 --step-modes "$STEP_MODES" \
  --longest-first --out "$MASKKV_BENCH_OUT" "$@"
