#!/usr/bin/env bash
# The tiny Llama on 4 CPU processes with gloo: TP=2 x PP=2 (megatron-core's tensor-parallel
# layers and 1F1B pipeline schedule), a few steps on the embedded corpus.
#
#   bash examples/tiny_cpu_parallel.sh           # ITERS=10 by default
#   DRY_RUN=1 bash examples/tiny_cpu_parallel.sh # the layout report only, one process
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/tiny_cpu_parallel-$(date +%Y%m%d-%H%M%S)}  # a new folder each time: one run per folder
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ARGS=(
    --model tiny --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    --train-iters "${ITERS:-10}" --eval-interval 10 --eval-iters 2
    --micro-batch-size 4 --global-batch-size 16 --log-interval 2
    --run-dir "$RUN" --no-save
)
if [[ -n ${DRY_RUN:-} ]]; then
    exec python pretrain_llama.py "${ARGS[@]}" --dry-run
fi
exec torchrun --nproc-per-node 4 pretrain_llama.py "${ARGS[@]}"
