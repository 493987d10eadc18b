#!/usr/bin/env bash
# CPU smoke run: the tiny Llama for 50 steps, then a resume at TP=2 x PP=2 from its checkpoint.
# Finishes in about a minute on 2 cores. DRY_RUN=1 prints both layouts instead (no training,
# so the second one is checked without its --load).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/cpu_smoke-$(date +%Y%m%d-%H%M%S)}  # a new folder each time: one run per folder
FIRST=(--train-iters 50 --eval-interval 25 --run-dir "$RUN")
RESUME=(--train-iters 60 --lr-decay-iters 50 --eval-interval 30  # the first run's schedule
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
        --run-dir "$RUN/resumed_tp2_pp2" --no-save)
if [[ -n ${DRY_RUN:-} ]]; then
    python pretrain_llama.py "${FIRST[@]}" --dry-run
    exec python pretrain_llama.py "${RESUME[@]}" --dry-run
fi
python pretrain_llama.py "${FIRST[@]}"
torchrun --nproc-per-node 4 pretrain_llama.py "${RESUME[@]}" --load "$RUN/checkpoints"
