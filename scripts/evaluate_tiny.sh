#!/usr/bin/env bash
# Evaluate a trained tiny model as docs/tiny-model.md selects and reports the stages (stage 20's rule onwards).
#   scripts/evaluate_tiny.sh runs/s21z3/final runs/eval-s21z3            # all three below
#   scripts/evaluate_tiny.sh runs/s21z3/final runs/eval-s21z3 selection  # or one of them (layout: only that)
# The model is first laid out exactly as it would be embedded (window 2128, summaries of 64 tokens, its summary
# block if it was trained with one) in OUT/model.
#   selection: the selection sample (stdlib-train, seed 5, full cache): single, multikey, open questions and absent
#              keys (niah_none), 50 per cell; lead summaries, 20 per cell; 512 and 1024 tokens
#   heldout:   the report on the held-out family (stdlib-heldout, seed 21, 20 per cell): five kinds, every default
#              policy at 16 and 64 entries
#   decision:  the held-out family again (seed 22), 100 single, multikey and absent-key tasks per length, full and
#              maskkv at 16 and 64, for this model and the embedded one side by side
# Tables: scripts/quality_table.py OUT/<part>. WORKERS=1 when the other core is busy (default 2).
set -euo pipefail
# one thread per worker; freed memory kept in the process (docs/tiny-model.md, "Training speed")
export OMP_NUM_THREADS=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2000000000
M=${MASKKV:-.venv/bin/maskkv}
PY=${PYTHON:-.venv/bin/python}
run=$1 out=$2 what=${3:-all}
case $what in all|layout|selection|heldout|decision) ;;
  *) echo "evaluate_tiny.sh: unknown part '$what' (all, layout, selection, heldout or decision)" >&2; exit 2 ;;
esac
mkdir -p "$out"
if [ ! -f "$out/model/config.json" ]; then
  $PY - "$run" "$out/model" <<'PY'
import json, sys
from pathlib import Path
from maskkv_cli.training.train import install_model
run, target = Path(sys.argv[1]), Path(sys.argv[2])
info = run / "training.json"
block = json.loads(info.read_text())["recipe"].get("summary_block") if info.is_file() else None
install_model(run, window=2128, summary_length=64, summary_block=block, target=target)
PY
fi
q() { $M bench quality --workers "${WORKERS:-2}" --quiet "$@"; }
L="--lengths 512,1k"
if [ "$what" = all ] || [ "$what" = selection ]; then
  q --model "$out/model" --haystack stdlib-train --seed 5 -n 50 $L \
    --tasks niah_single,niah_multikey,open_question,niah_none --policies full --out "$out/selection"
  q --model "$out/model" --haystack stdlib-train --seed 5 -n 20 $L --tasks lead_summary --policies full \
    --out "$out/selection-summaries"
fi
if [ "$what" = all ] || [ "$what" = heldout ]; then
  q --model "$out/model" --haystack stdlib-heldout --seed 21 -n 20 $L \
    --tasks niah_single,niah_multikey,open_question,niah_none,lead_summary --budgets 16,64 --out "$out/heldout"
fi
if [ "$what" = all ] || [ "$what" = decision ]; then
  for model in "$out/model" maskkv_cli/assets/tiny-llada; do
    name=$([ "$model" = "$out/model" ] && echo candidate || echo embedded)
    q --model "$model" --haystack stdlib-heldout --seed 22 -n 100 $L --tasks niah_single,niah_multikey,niah_none \
      --policies full,maskkv --budgets 16,64 --out "$out/decision-$name"
  done
fi
