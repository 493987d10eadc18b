#!/usr/bin/env bash
# CPU smoke run: the tiny Llama for 50 steps, then a resume at TP=2 x PP=2 from its checkpoint.
# Finishes in about a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/cpu_smoke}
python pretrain_llama.py --train-iters 50 --eval-interval 25 --run-dir "$RUN"
torchrun --nproc-per-node 4 pretrain_llama.py --train-iters 60 --eval-interval 30 \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --load "$RUN/checkpoints" --run-dir "$RUN/resumed_tp2_pp2" --no-save
