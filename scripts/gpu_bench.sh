#!/usr/bin/env bash
# Speed sweep for a 10-minute window on one H200 (or any CUDA GPU with >= 80 GB):
# the real LLaDA-8B shape with random bf16 weights (weights do not change speed), prompts 1k..32k,
# gen length 256 (256 steps, blocks of 32), none vs full vs MaskKV at budgets 64/256/1024, each case in a fresh
# process, the limit line per case, results folder + Rich table.
#
#   scripts/gpu_bench.sh                      # the whole sweep into runs/bench-speed-h200
#   LENGTHS=16k,32k scripts/gpu_bench.sh      # fewer prompt lengths
#   scripts/gpu_bench.sh --no-limit --json    # extra options go to `maskkv bench speed`
#   STEP_MODES=eager,cuda-graph LENGTHS=32k BUDGETS=256 OUT=runs/bench-steps-h200 scripts/gpu_bench.sh
#                                             # eager steps vs one CUDA graph per step, same run
#
# Finished rows are written after every case; if the window closes mid-sweep, run the same command again and
# the finished cases are reused (same --out folder, same settings). Expect roughly 15-25 s per case (process start,
# 16 GB of weights, warm-up, run, limit); `none` is timed for 3 steps and extrapolated.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT="${OUT:-runs/bench-speed-h200}"
LENGTHS="${LENGTHS:-1k,2k,4k,8k,16k,32k}"
BUDGETS="${BUDGETS:-64,256,1024}"
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
  --out "$OUT" "$@"
