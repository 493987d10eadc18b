"""STQuant's part of ``--dry-run``: what ``m`` and ``v`` take per GPU at 4 and at 8 bits.

The report's ``optim`` column counts AdamW's ``m`` and ``v`` in FP32 (8 B/param, plus the FP32
main parameters of BF16 weights). Under ``--optimizer stquant-adamw`` their widths are chosen
during training, from gradients the dry run does not have, so this part adds a column with
both moments' bytes per GPU if every layer had 4 bits (the floor) and 8 bits (the width the
score's ``Φ`` anchors): ``2 · (b + 32 / B) / 8`` bytes per parameter for ``b`` bits and
blocks of ``B`` (codes plus one FP32 scale per block), divided over DP like the optimizer
column when the optimizer is distributed. Tensors below ``--stquant-min-numel`` (norms,
~0.1 % of a model) are counted at the same rate. Training measures the real figure
(``stquant_state_bytes_per_param`` in the metrics).
"""

from __future__ import annotations

from megatron_ext.extension import DryRunPart
from megatron_ext.training.dry_run.estimates import GIB

WIDTHS = (4, 8)


def state_bytes_per_param(bits: int, block: int) -> float:
    """Bytes of ``m`` and ``v`` per parameter at ``bits`` with one FP32 scale per block."""
    return 2 * (bits + 32 / block) / 8


def estimate(args, context) -> DryRunPart | None:
    if args.optimizer != "stquant-adamw":
        return None
    layout = context.layout
    shards = layout.dp if layout.distributed_optimizer or layout.fsdp else 1
    rate = {b: state_bytes_per_param(b, args.stquant_block_size) for b in WIDTHS}
    per_gpu = [{b: s.per_gpu * rate[b] / shards for b in WIDTHS} for s in context.stages]
    return DryRunPart(
        columns=("m,v 4|8b",),
        cells=tuple((f"{g[4] / GIB:.1f}|{g[8] / GIB:.1f}",) for g in per_gpu),
        stage_json=tuple({f"stquant_state_bytes_{b}bit": g[b] for b in WIDTHS}
                         for g in per_gpu),
        lines=(f"STQuant m, v: {rate[4]:.3f} B/param if every layer has 4 bits, {rate[8]:.3f} "
               f"at 8 (blocks of {args.stquant_block_size}); the optim column counts them in "
               "FP32 (8 B/param); the widths are chosen during training",),
        json={"stquant": {"bytes_per_param": {str(b): rate[b] for b in WIDTHS},
                          "block": args.stquant_block_size}})
