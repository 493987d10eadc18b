"""torchrun worker (2 ranks, gloo): quantized column + row linears at TP=2, with and without
sequence parallelism, against the same layers at TP=1 built on every rank; then the cross-rank
plan-hash check. Exits non-zero on the first mismatch.

Shapes keep every 128-block inside one TP shard (H = F/2 = 256: each rank's slice of the
weights and of dy is whole 1x128 tiles / 128x128 blocks), so the quantized operands are the
same values at both layouts and only float32 summation order differs.
"""

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig

from megatron_ext.compat import cpu
from megatron_ext.precision.layers import quantized_class
from megatron_ext.precision.controller import verify_same_plan
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.training.distributed import init_process_group, resolve_launch

S, B, H, F = 160, 2, 256, 512  # T = 320 tokens: 1x128 tiles along T end ragged
FP8_TENSOR = SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e4m3")
FORMATS = {"uniform-fp8": (UNIFORM["fp8"], "emulated"),
           "mx": (SiteFormats("mxfp8", "mxfp4", "mxfp8_e5m2"), "emulated"),
           # per tensor: the emulated GEMM keeps q(x) for wgrad, the real one q(x) in FP8
           "fp8-tensor": (FP8_TENSOR, "emulated"), "fp8-tensor-real": (FP8_TENSOR, "real")}


def _layers(tp_group, sequence_parallel: bool, formats: SiteFormats, execution: str):
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                               use_cpu_initialization=True, sequence_parallel=sequence_parallel,
                               tensor_model_parallel_size=tp_group.size(),
                               pipeline_model_parallel_size=1)
    kw = dict(config=config, init_method=torch.nn.init.zeros_, bias=True, tp_group=tp_group)
    col = quantized_class(ColumnParallelLinear, 0, "fc1", fp8_execution=execution)(
        H, F, gather_output=False, skip_bias_add=False, **kw)
    row = quantized_class(RowParallelLinear, 0, "fc2", fp8_execution=execution)(
        F, H, input_is_parallel=True, skip_bias_add=False, **kw)
    size, rank = tp_group.size(), tp_group.rank()
    g = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(F, H, generator=g) * 0.05, torch.randn(F, generator=g)
    w2, b2 = torch.randn(H, F, generator=g) * 0.05, torch.randn(H, generator=g)
    shard = slice(rank * F // size, (rank + 1) * F // size)
    with torch.no_grad():
        col.weight.copy_(w1[shard]), col.bias.copy_(b1[shard])
        row.weight.copy_(w2[:, shard]), row.bias.copy_(b2)
    col.formats = row.formats = formats
    return col, row, shard


def _run(tp_group, sequence_parallel, formats, execution):
    """Output, dx, and the four parameter grads (shards at TP=2); the weight shard; what the
    column layer saved for its backward."""
    col, row, shard = _layers(tp_group, sequence_parallel, formats, execution)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    x[7, 1] *= 40  # an outlier token
    if sequence_parallel:  # each rank holds its slice of the sequence
        rows = slice(tp_group.rank() * S // 2, (tp_group.rank() + 1) * S // 2)
        x, dy = x[rows], dy[rows]
    x = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        hidden = col(x)[0]
    y = row(hidden)[0]
    y.backward(dy)
    if sequence_parallel:  # as megatron's finalize_model_grads does for SP-marked params
        dist.all_reduce(row.bias.grad, group=tp_group)
    return ([y, x.grad, col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad], shard,
            saved)


def _keeps_its_rows(name, saved, rank):
    """Under SP the column layer's GEMM reads the gathered x (S rows) but keeps only this
    rank's S/2 rows of it (x, q(x), or q(x) in FP8) for wgrad, as megatron's linear does."""
    sizes = {t.numel() for t in saved}
    if S * B * H in sizes or S // 2 * B * H not in sizes:
        raise AssertionError(f"{name} rank {rank}: the column layer keeps "
                             f"{sorted(sizes)} elements, not its {S // 2 * B * H} rows of x")
    if name.endswith("real-sp") and not any(t.element_size() == 1 for t in saved):
        raise AssertionError(f"{name} rank {rank}: q(x) not kept in FP8 (no real GEMM ran)")


def _compare(name, tp1, tp2, shard, sequence_parallel, rank):
    y1, dx1, dw1, db1, dw2, db2 = tp1
    if sequence_parallel:
        rows = slice(rank * S // 2, (rank + 1) * S // 2)
        y1, dx1 = y1[rows], dx1[rows]
    expected = [y1, dx1, dw1[shard], db1[shard], dw2[:, shard], db2]
    for what, got, ref in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), tp2, expected):
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if err > 1e-5:
            raise AssertionError(f"{name} rank {rank}: {what} differs by {err:.2e} (relative)")
    print(f"OK {name} rank {rank}", flush=True)


def main() -> int:
    cpu.activate()
    init_process_group(resolve_launch(), "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    singletons = [dist.new_group([r]) for r in range(dist.get_world_size())]
    tp2 = parallel_state.get_tensor_model_parallel_group()
    for fmt_name, (formats, execution) in FORMATS.items():
        tp1, shard, _ = _run(singletons[rank], False, formats, execution)
        for sp in (False, True):
            got, shard, saved = _run(tp2, sp, formats, execution)
            name = f"{fmt_name}{'-sp' if sp else ''}"
            if sp:
                _keeps_its_rows(name, saved, rank)
            _compare(name, tp1, got, shard, sp, rank)
    plan = PrecisionPlan({"L0.fc1": UNIFORM["fp8"]})
    verify_same_plan(plan)
    try:
        verify_same_plan(plan.replace(step=rank))
    except RuntimeError as exc:
        print(f"OK mismatch rank {rank}: {exc}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
