"""torchrun worker (2 ranks, gloo): GaussWS on TP=2 shards with the real collectives (tile
maxima all-reduced MAX, bit-width gradients all-reduced SUM in the backward) against TP=1
computed on every rank. Exits non-zero on the first mismatch (run by test_gaussws_tp.py)."""

import sys

import torch
import torch.distributed as dist

from megatron_ext.methods.gaussws import GaussWSConfig, GaussWSWeight, ShardLayout

KEY = 31337
# (full shape, split dim, parts): tiny Llama fc2 (5.5 tiles per rank), fused SwiGLU fc1,
# a ragged column-parallel weight
CASES = [((128, 352), 1, 1), ((704, 128), 0, 2), ((100, 70), 0, 1)]


def _check(name, ok):
    if not ok:
        print(f"rank {dist.get_rank()}: {name} differs", flush=True)
        sys.exit(1)


def _case(shape, dim, parts, dtype):
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    cfg = GaussWSConfig(("fc2",))
    ref = GaussWSWeight(ShardLayout.full(*shape), cfg)
    with torch.no_grad():
        ref.b_i.uniform_(0.3, 1.2, generator=gen)
    w_ref = full.clone().requires_grad_()
    w_hat = ref(w_ref, KEY)
    w_hat.backward(g)

    layout = ShardLayout.tensor_parallel(shape, size, rank, dim, parts)
    rows, (c0, c1) = layout.global_rows(), layout.col_range
    mod = GaussWSWeight(layout, cfg)
    with torch.no_grad():
        mod.b_i.copy_(ref.b_i)
    shard = full[rows][:, c0:c1].clone().requires_grad_()
    out = mod(shard, KEY, group=dist.group.WORLD)
    raw = torch.int16 if dtype == torch.bfloat16 else torch.int32
    _check(f"{shape} ŵ", torch.equal(out.view(raw), w_hat.detach()[rows][:, c0:c1].view(raw)))
    out.backward(g[rows][:, c0:c1])
    _check(f"{shape} dL/dw", torch.equal(shard.grad, g[rows][:, c0:c1]))
    err = (mod.b_i.grad - ref.b_i.grad).abs().max() / ref.b_i.grad.abs().max()
    _check(f"{shape} dL/db_i (rel err {err:.2e})", err <= 1e-5)
    grads = [torch.empty_like(mod.b_i.grad) for _ in range(size)]
    dist.all_gather(grads, mod.b_i.grad)
    _check(f"{shape} dL/db_i across ranks", all(torch.equal(x, grads[0]) for x in grads))


def main():
    dist.init_process_group("gloo")
    for shape, dim, parts in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            _case(shape, dim, parts, dtype)
    print(f"rank {dist.get_rank()}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
