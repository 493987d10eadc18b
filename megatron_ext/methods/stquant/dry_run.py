"""STQuant's part of ``--dry-run``: the quantized ``m`` and ``v`` in the optimizer memory.

Under ``--optimizer stquant-adamw`` both moments are stored as ``b``-bit codes plus one FP32
scale per block of ``B`` elements: ``2 · (b + 32 / B) / 8`` bytes per parameter (8 at
``b = 32``, which keeps float32 values and no scales), divided over DP like the rest of the
optimizer state when the optimizer is distributed. The widths are chosen during training,
from gradients the dry run does not have, so it assumes one width for every layer:
``--stquant-dry-run-bits`` (default: ``--stquant-fixed-bits`` when that fixes them, else 8,
the width the score's ``Φ`` anchors). The part gives these bytes as the report's optimizer
moments (``DryRunPart.moments``), which replace FP32 Adam's 8 B/param in the ``optim``
column (the FP32 main parameters of BF16 weights stay), and shows them in a ``m,v GiB``
column. Tensors below ``--stquant-min-numel`` (norms, ~0.1 % of a model), which keep float32
state, are counted at the same rate. Training measures the real figure
(``stquant_state_bytes_per_param`` in the metrics).
"""

from __future__ import annotations

from megatron_ext.extension import DryRunPart
from megatron_ext.training.dry_run.estimates import GIB


def state_bytes_per_param(bits: int, block: int) -> float:
    """Bytes of ``m`` and ``v`` per parameter at ``bits`` with one FP32 scale per block (no
    scale at 32 bits)."""
    return 2 * (bits + (0 if bits == 32 else 32 / block)) / 8


def estimate(config, context) -> DryRunPart | None:
    """The part of a run whose STQuant ``config`` (``STQuantConfig``; None: off) is given."""
    if config is None:
        return None
    layout, bits, block = context.layout, config.dry_run_bits, config.block
    shards = layout.dp if layout.distributed_optimizer or layout.fsdp else 1
    rate = state_bytes_per_param(bits, block)
    per_gpu = tuple(s.per_gpu * rate / shards for s in context.stages)
    return DryRunPart(
        columns=("m,v GiB",),
        cells=tuple((f"{b / GIB:.1f}",) for b in per_gpu),
        stage_json=tuple({"stquant_state_bytes": b} for b in per_gpu),
        moments=per_gpu,
        moments_how=f"STQuant m, v at {bits} bits {rate:.3f} B/param",
        lines=(f"STQuant m, v: {rate:.3f} B/param with every layer at {bits} bits "
               f"(--stquant-dry-run-bits; blocks of {block}), counted in the optim column in "
               f"place of FP32's 8; training chooses the widths (4 bits: "
               f"{state_bytes_per_param(4, block):.3f}, 16: "
               f"{state_bytes_per_param(16, block):.3f})",),
        json={"stquant": {"bits": bits, "bytes_per_param": rate, "block": block}})
