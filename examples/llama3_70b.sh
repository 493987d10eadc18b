#!/usr/bin/env bash
# Llama-3 70B layout of the SNIP paper's run, per node (8 GPUs); launch one per node, e.g.
#   NNODES=8 NODE_RANK=$i MASTER_ADDR=head bash examples/llama3_70b.sh
#   DRY_RUN=1 bash examples/llama3_70b.sh        # the per-stage report, one process, no GPU
# TP=4 x PP=8 x DP=2 = 64 GPUs. (The paper used FSDP=2; add --use-megatron-fsdp to shard
# parameters over the DP=2 groups, GPU only.)
set -euo pipefail
if [[ -n ${DRY_RUN:-} ]]; then  # a dry run reads neither data nor tokenizer
    DATA=${DATA:-unused} TOKENIZER=${TOKENIZER:-unused}
fi
CKPT=${CKPT:-checkpoints/llama3-70b}
ARGS=(
    --model llama3-70b
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 --data-parallel-size 2
    --num-layers-per-virtual-pipeline-stage 5 --sequence-parallel --use-distributed-optimizer
    --micro-batch-size 1 --global-batch-size 1024 --seq-length 8192
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-warmup-iters 2000 --train-iters 250000
    --data-path "${DATA:?}" --tokenizer-model "${TOKENIZER:?}"
    --save "$CKPT" --save-interval 500
)
if [[ -d $CKPT ]]; then ARGS+=(--load "$CKPT"); fi  # resume
if [[ -n ${DRY_RUN:-} ]]; then
    exec python pretrain_llama.py "${ARGS[@]}" --dry-run
fi
exec torchrun --nnodes "${NNODES:-8}" --node-rank "${NODE_RANK:?}" --nproc-per-node 8 \
    --master-addr "${MASTER_ADDR:?}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_llama.py "${ARGS[@]}"
