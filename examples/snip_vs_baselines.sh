#!/usr/bin/env bash
# SNIP against the §6.1 baselines and uniform FP8 / FP4 on the tiny Llama, CPU (SNIP Fig. 8 /
# Table 1 in small): the grid examples/compare/snip_grid.yaml (21 runs of 200 steps per seed
# on the embedded corpus) through tools/compare_precision.py, 2 at a time — tables in
# $OUT/results.md, loss and gap PNGs in $OUT/img — then SNIP's own figures of the first
# seed's runs with tools/plot_precision.py into $IMG: the final plans of snip / min-rel-err /
# e-layer-type at each budget (Fig. 7), the divergences of SNIP's last refresh at E_t = 0.75
# (Fig. 10) and its plan over the refreshes (Fig. 11). Finished runs are kept, so running it
# again resumes the grid. See docs/compare.md.
#
#   bash examples/snip_vs_baselines.sh                     # 3 seeds, ~1 h per seed on 2 cores
#   SEEDS=1234 bash examples/snip_vs_baselines.sh          # one seed
#   JOBS=1 OUT=/tmp/sq bash examples/snip_vs_baselines.sh --base-flags="--train-iters 40"
#   DRY_RUN=1 bash examples/snip_vs_baselines.sh           # the layout of one SNIP run
#   python tools/compare_precision.py --config examples/compare/snip_grid.yaml \
#       --out runs/snip_grid --dry-run                     # the jobs and their commands
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/snip_grid}
SEEDS=${SEEDS:-1234,1235,1236}
IMG=${IMG:-docs/img/snip}
GRID=(--config examples/compare/snip_grid.yaml --out "$OUT" --seeds "$SEEDS")
# the grid's E_t = 0.75 SNIP run (its flags as in snip_grid.yaml), for DRY_RUN's layout check
ARGS=(--model tiny --train-iters 200 --lr 1e-3 --min-lr 1e-4 --eval-interval 50 --eval-iters 10
      --precision snip --snip-budget 0.75 --snip-start 20 --snip-interval 50 --snip-apply-lag 2)
if [[ -n ${DRY_RUN:-} ]]; then
    exec python pretrain_llama.py "${ARGS[@]}" --seed "${SEEDS%%[, ]*}" --dry-run
fi
python tools/compare_precision.py "${GRID[@]}" --jobs "${JOBS:-2}" "$@"

first=$OUT/runs
seed=seed_${SEEDS%%,*}
mkdir -p "$IMG"
cp "$OUT/img/loss_0.75.png" "$IMG/loss_budget_0.75.png"
cp "$OUT/img/loss_0.75_end.png" "$IMG/loss_budget_0.75_end.png"
for policy in snip min-rel-err e-layer-type; do
    for budget in 0.25 0.5 0.75; do
        python tools/plot_precision.py plan "$first/$policy-$budget/$seed/precision_plan.json" \
            --out "$IMG/plan_${policy}_$budget.png"
    done
done
snip=$first/snip-0.75/$seed
last=$(find "$snip/snip" -name divergence.json | sort | tail -n 1)
for metric in dL dW; do
    python tools/plot_precision.py divergence "$last" --metric "$metric" \
        --out "$IMG/divergence_$metric.png"
done
python tools/plot_precision.py evolution "$snip" --out "$IMG/evolution_snip_0.75.png"
