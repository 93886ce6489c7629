#!/usr/bin/env bash
# The stages that trained the shipped tiny model (maskkv_cli/assets/tiny-llada), as they were run on a
# 2-core CPU with one torch thread (stage 12 with two; docs/tiny-model.md has times and metrics). Each stage
# starts from the weights and tokenizer of the one before; the first builds the tokenizer (seed 0).
set -euo pipefail
export OMP_NUM_THREADS=1
M=${MASKKV:-.venv/bin/maskkv}
R=${RUNS:-runs}
# 1. copying digits at 40-64 tokens, single needle (run for 750 of a 1000-step schedule)
$M train-tiny --out $R/tiny-stage1 --steps 1000 --stop-after 750 --kinds niah_single --min-len 40 --max-len 64 \
  --curriculum-steps 1 --json
# 2. both needle kinds, lengths growing to 512 (run for 1000 of 2000 steps: it plateaued)
$M train-tiny --out $R/tiny-v3 --init-from $R/tiny-stage1/final --steps 2000 --stop-after 1000 \
  --curriculum-steps 1200 --json
# 3.-5. single needle, lengths up to 128, 160, then 256, with a falling learning rate
$M train-tiny --out $R/tiny-v4 --init-from $R/tiny-v3/final --steps 1500 --kinds niah_single --min-len 40 \
  --max-len 128 --curriculum-steps 300 --lr 1.5e-3 --json
$M train-tiny --out $R/tiny-v5 --init-from $R/tiny-v4/final --steps 1500 --kinds niah_single --min-len 40 \
  --max-len 160 --curriculum-steps 500 --lr 1e-3 --json
$M train-tiny --out $R/tiny-v6 --init-from $R/tiny-v5/final --steps 4500 --stop-after 1800 --kinds niah_single \
  --min-len 40 --max-len 256 --curriculum-steps 1500 --lr 6e-4 --json
# 6. single needle up to 512 tokens (the embedded default until stage 8)
$M train-tiny --out $R/tiny-v7 --init-from $R/tiny-v6/final --steps 1000 --kinds niah_single --min-len 40 \
  --max-len 512 --curriculum-steps 300 --lr 4e-4 --json
# 7. key matching on short contexts (24-96 tokens): three multikey tasks to one single-needle task, the whole
#    answer masked for half the examples
$M train-tiny --out $R/tiny-mk1 --init-from $R/tiny-v7/final --steps 8000 --kinds niah_multikey:3,niah_single:1 \
  --min-len 24 --max-len 96 --curriculum-steps 1 --lr 1e-3 --full-mask 0.5 --json
# 8. both kinds up to 512 tokens, RoPE positions spread over 2048 with PoSE-style skips (distances the contexts
#    never reach)
$M train-tiny --out $R/tiny-mk2a --init-from $R/tiny-mk1/final --steps 1500 --kinds niah_multikey:2,niah_single:1 \
  --min-len 40 --max-len 512 --curriculum-steps 500 --lr 5e-4 --full-mask 0.5 --position-window 2048 --json
# 9. two more layers (copies of layers 1 and 3 with zeroed output projections: the same function at the start),
#    then the stage-8 recipe; the shipped lineage goes on from step 1100 of this 3000-step schedule (run to the
#    end, this stage was the embedded default before stage 11)
$M train-tiny --out $R/tiny-g6 --init-from $R/tiny-mk2a/final --grow-layers 2 --steps 3000 --stop-after 1100 \
  --kinds niah_multikey:2,niah_single:1 --min-len 40 --max-len 512 --curriculum-steps 300 --lr 5e-4 \
  --full-mask 0.5 --position-window 2048 --json
# 10. RoPE base 10,000 -> 500,000 (more slowly turning frequencies for matching keys far away), the same recipe
$M train-tiny --out $R/tiny-g6r --init-from $R/tiny-g6/final --rope-theta 500000 --steps 2500 \
  --kinds niah_multikey:2,niah_single:1 --min-len 40 --max-len 512 --curriculum-steps 300 --lr 5e-4 \
  --full-mask 0.5 --position-window 2048 --json
# 11. 3 to 7 distractor needles per multikey example (the benchmark has 3), multikey 3:1 (the embedded default
#     until stage 12, installed with a window of 1104 tokens)
$M train-tiny --out $R/tiny-d7r --init-from $R/tiny-g6r/final --steps 3000 --kinds niah_multikey:3,niah_single:1 \
  --min-len 40 --max-len 512 --curriculum-steps 1 --lr 4e-4 --full-mask 0.5 --position-window 2048 \
  --distractors 3-7 --json
# 12. the stage-11 recipe on contexts of 128-1024 tokens (the longest length the benchmark tests), lr 3e-4, two
#     threads, seed 12; installed as the embedded default with a window of 2128 tokens, twice the longest training
#     sequence (1064: 1024 of context, the template and question, 8 answer tokens)
$M train-tiny --out $R/tiny-l1k --init-from $R/tiny-d7r/final --steps 2200 --kinds niah_multikey:3,niah_single:1 \
  --min-len 128 --max-len 1024 --curriculum-steps 1 --lr 3e-4 --full-mask 0.5 --position-window 2048 \
  --distractors 3-7 --threads 2 --eval-n 40 --eval-every 550 --seed 12 --json --install --window 2128
# Stages 13 and 14 were run but are NOT shipped (neither passed the selection rule in docs/tiny-model.md: both
# lost multikey accuracy); they are here so the attempt can be replayed and continued.
# 13. reading other text (#21), "not in the document" and lead summaries (#25): the stage-12 model (as installed,
#     window 2128) on haystacks of real text every Python has (bench/sources.py: docstrings of the training
#     modules of the standard library, the same typeset as a PDF and read back, pydoc topics, the project's docs,
#     the license) beside the corpus; unanswerable questions (niah_none, answer NO_ANSWER) and lead summaries
#     (lead_summary, 64-token answer region, batches of their own); batch 16, contexts 128-768, one thread,
#     seed 13. The held-out family (stdlib-heldout, pdf-heldout: modules chosen by a hash of their name) is never
#     trained on.
$M train-tiny --out $R/tiny-read --init-from $R/tiny-l1k/final --steps 700 --batch-size 16 \
  --kinds niah_multikey:3,niah_single:1,niah_none:1.5,lead_summary:1 \
  --sources corpus:1,pydoc-topics:1,stdlib-train:2,pdf-train:2,docs:0.5,license:0.5 \
  --min-len 128 --max-len 768 --curriculum-steps 1 --lr 3e-4 --full-mask 0.5 --position-window 2048 \
  --distractors 3-7 --summary-len 64 --eval-n 12 --eval-every 100 --eval-source stdlib-train --seed 13 --json
# 14. the stage-13 recipe on contexts up to 1024 tokens, no-answer questions weighted 3 (0 to 7 needles for other
#     keys), summaries 1.5, lr 2e-4, seed 14 (stopped at 700 of a 900-step schedule)
$M train-tiny --out $R/tiny-read2 --init-from $R/tiny-read/final --steps 900 --stop-after 700 --batch-size 16 \
  --kinds niah_multikey:3,niah_single:1,niah_none:3,lead_summary:1.5 \
  --sources corpus:1,pydoc-topics:1,stdlib-train:2,pdf-train:2,docs:0.5,license:0.5 \
  --min-len 128 --max-len 1024 --curriculum-steps 1 --lr 2e-4 --full-mask 0.5 --position-window 2048 \
  --distractors 0-7 --summary-len 64 --eval-n 12 --eval-every 150 --eval-source stdlib-train --seed 14 --json
