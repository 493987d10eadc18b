#!/usr/bin/env bash
# SNIP against the §6.1 baselines and uniform FP8 / FP4 on the tiny Llama, CPU (SNIP Fig. 8 /
# Table 1 in small): 21 runs of 200 steps per seed on the embedded corpus, 2 at a time, then
# the table (runs/snip_quality/results.md) and the PNGs (docs/img/snip/). Finished runs are
# kept, so running it again resumes the grid. See python benchmarks/snip_quality.py --help.
#
#   bash examples/snip_vs_baselines.sh                     # ~1 h per seed on 2 CPU cores
#   SEEDS="1234 1235 1236" bash examples/snip_vs_baselines.sh   # and the seed spread
#   JOBS=1 OUT=/tmp/sq bash examples/snip_vs_baselines.sh --train-iters 40
#   DRY_RUN=1 bash examples/snip_vs_baselines.sh           # the layout of one SNIP run
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
read -r -a SEEDS <<< "${SEEDS:-1234}"
ARGS=(--train-iters 200 --lr 1e-3 --min-lr 1e-4)  # every run's (pretrain's flags too)
if [[ -n ${DRY_RUN:-} ]]; then
    exec python pretrain_llama.py --model tiny "${ARGS[@]}" --seed "${SEEDS[0]}" \
        --precision snip --snip-budget 0.75 --snip-start 20 --snip-interval 50 \
        --snip-apply-lag 2 --dry-run
fi
exec python benchmarks/snip_quality.py "${ARGS[@]}" --seeds "${SEEDS[@]}" \
    --out "${OUT:-runs/snip_quality}" --jobs "${JOBS:-2}" --img-dir docs/img/snip \
    --budgets 0.25 0.5 0.75 \
    --policies snip random min-abs-err min-rel-err e-layer-type e-layer-id "$@"
