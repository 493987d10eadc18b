"""Core attention alone, ``--attention-backend local`` against ``sdpa`` (not a test): what each
keeps for backward and its forward + backward time, at one layer's shape.

    nice -n 19 python benchmarks/attention_backends.py                  # CPU, FP32, seq 2048
    python benchmarks/attention_backends.py --seq-length 4096 --json out.json   # on a GPU: BF16

Per backend: megatron-core's local ``DotProductAttention`` and ``SDPAttention`` built from the
same ``TransformerConfig`` (``training/model.py``) in a one-process megatron world, fed the
same ``[s, b, heads, d]`` query and ``[s, b, groups, d]`` key / value; ``kept MiB`` is what
autograd saves for backward (saved-tensor hooks, every tensor counted once per save), ``peak
MiB`` the CUDA allocator's peak over forward + backward above the inputs (GPU only), ``ms`` the
fastest of ``--repeats`` forward + backward passes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _modules(args):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.training.model import transformer_config
    from megatron_ext.training.sdpa import SDPAttention

    config = transformer_config(args)
    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
              attention_type="self", softmax_scale=None)
    return {"local": DotProductAttention(**kw), "sdpa": SDPAttention(**kw)}


def _inputs(args, device, dtype):
    d = args.hidden_size // args.num_attention_heads
    shapes = [(args.seq_length, args.micro_batch_size, heads, d)
              for heads in (args.num_attention_heads, args.num_query_groups,
                            args.num_query_groups)]
    return [torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in shapes]


def measure(module, qkv, repeats: int) -> dict:
    """Bytes kept for backward, CUDA peak, fastest forward + backward of ``module``."""
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*qkv, None).sum().backward()
    cuda = qkv[0].is_cuda
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        module(*qkv, None).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return {"kept_mib": sum(kept) / 2**20, "peak_mib": peak, "ms": min(times) * 1e3}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-length", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences")
    p.add_argument("--num-attention-heads", type=int, default=8, help="query heads")
    p.add_argument("--num-query-groups", type=int, default=2, help="key/value heads")
    p.add_argument("--kv-channels", type=int, default=64, help="head dimension")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per backend")
    p.add_argument("--json", default=None, help="also write the results here")
    opts = p.parse_args(argv)
    from megatron_ext.convert.megatron_files import megatron_runtime
    from megatron_ext.training.arguments import parse_args

    args = parse_args("llama", [
        "--mock-data", "--seq-length", str(opts.seq_length),
        "--max-position-embeddings", str(opts.seq_length),
        "--micro-batch-size", str(opts.micro_batch_size),
        "--num-attention-heads", str(opts.num_attention_heads),
        "--num-query-groups", str(opts.num_query_groups),
        "--hidden-size", str(opts.num_attention_heads * opts.kv_channels)], world_size=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    with megatron_runtime(args):
        qkv = _inputs(args, device, dtype)
        rows = {name: measure(m.to(device), qkv, opts.repeats)
                for name, m in _modules(args).items()}
    print(f"{device} {dtype}: seq {opts.seq_length}, batch {opts.micro_batch_size}, heads "
          f"{opts.num_attention_heads}, groups {opts.num_query_groups}, d {opts.kv_channels}")
    for name, r in rows.items():
        peak = "" if r["peak_mib"] is None else f", peak {r['peak_mib']:.1f} MiB"
        print(f"{name:6s} kept for backward {r['kept_mib']:8.1f} MiB{peak}, "
              f"fwd+bwd {r['ms']:8.1f} ms")
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump({"device": device, "dtype": str(dtype), "shape": vars(opts),
                       "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
