#!/usr/bin/env bash
# The tiny Llama on this machine's CPU, one process: a short run on the embedded corpus (built
# and cached on first use, ~20 s), with a checkpoint in runs/tiny_cpu/checkpoints.
#
#   bash examples/tiny_cpu.sh                    # ITERS=50 by default
#   DRY_RUN=1 bash examples/tiny_cpu.sh          # the layout report only
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/tiny_cpu-$(date +%Y%m%d-%H%M%S)}  # a new folder each time: one run per folder
ARGS=(
    --model tiny --train-iters "${ITERS:-50}" --eval-interval 25 --eval-iters 4
    --micro-batch-size 8 --global-batch-size 16 --log-interval 10
    --run-dir "$RUN"
)
if [[ -n ${DRY_RUN:-} ]]; then
    exec python pretrain_llama.py "${ARGS[@]}" --dry-run
fi
exec python pretrain_llama.py "${ARGS[@]}"
