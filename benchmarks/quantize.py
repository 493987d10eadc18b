"""Throughput of the fake-quantization references on CPU (not a test).

Quantizes a SIZE x SIZE float32 tensor with each format and prints input GB/s beside
``clone()`` (the memory-bandwidth floor: one read, one write) and beside torchao's MX /
NVFP4 emulation when torchao is installed, checking that the results are bit-identical.
With ``--stored``, also times real quantization (``quantize`` to packed codes and scales,
``dequantize`` back) and checks that the round trip is ``fake_quant`` bit for bit. With
``--device cuda``, prints :func:`run`'s rows instead: ``fake_quant`` as dispatched on that
device (the Triton kernels on a GPU) against ``clone()``, each checked bit for bit against the
torch reference on CPU.

    python benchmarks/quantize.py                 # 4096x4096, 2 threads, default formats
    python benchmarks/quantize.py --formats mxfp4 nvfp4 --repeat 10
    python benchmarks/quantize.py --stored --no-torchao
    python benchmarks/quantize.py --device cuda   # the GPU table (about 30 s on an H100)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

try:
    from megatron_ext.formats import dequantize, fake_quant, fake_quant_2d, get_format, quantize
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megatron_ext.formats import dequantize, fake_quant, fake_quant_2d, get_format, quantize

DEFAULT_FORMATS = [
    "mxfp4", "mxfp8", "mxfp6_e2m3", "nvfp4", "mxfp4+sr",
    "fp8_e4m3", "fp8_e4m3@row", "fp8_e4m3@tile128", "fp8_e4m3@block128", "fp8_e5m2@tile128",
    "fp4_e2m1@tile128", "fp4_e2m1@block128", "fp4_e2m1@tile128+sr", "int8@row", "int4@tile128",
    "bf16",
]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=int, default=4096, help="rows = cols of the input (default 4096)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per row; the best is kept")
    p.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS, help="format names to time")
    p.add_argument("--no-torchao", action="store_true", help="skip the torchao comparison rows")
    p.add_argument("--stored", action="store_true", help="also time quantize / dequantize")
    p.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall time (default) or this process's CPU time, steadier on a shared box "
        "(with --threads 1 it is the work done; GB/s then means per CPU second)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random input (default 0)")
    p.add_argument(
        "--device",
        default=None,
        help="time fake_quant as dispatched on this device (e.g. cuda: the Triton kernels) at "
        "the --size x --size input in float32 and bfloat16, checked against the CPU reference; "
        "prints JSON rows (--formats defaults to DEVICE_FORMATS)",
    )
    return p.parse_args(argv)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""The clocks ``--clock`` chooses from."""


def best_seconds(fn, repeat: int, clock: str = "wall") -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = CLOCKS[clock]()
        fn()
        times.append(CLOCKS[clock]() - t0)
    return min(times)


def torchao_references() -> dict:
    """name -> quantize-dequantize function from torchao, or {} when it is missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
            from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import (
                nvfp4_quantize,
                per_tensor_amax_to_scale,
            )
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return {}

    def mx(elem_dtype):
        def run(x):
            scale, data = to_mx(x, elem_dtype, 32)
            return to_dtype(data, scale, elem_dtype, 32, x.dtype)

        return run

    def nvfp4(x):
        t = per_tensor_amax_to_scale(x.abs().max())
        scale, data = nvfp4_quantize(x, 16, t)
        q = f4_unpacked_to_f32(unpack_uint4(data)).view(x.shape[0], -1, 16)
        return (q * (t * scale.to(torch.float32)).unsqueeze(-1)).view(x.shape)

    return {
        "mxfp4": mx(torch.float4_e2m1fn_x2),
        "mxfp8": mx(torch.float8_e4m3fn),
        "mxfp6_e2m3": mx("fp6_e2m3"),
        "nvfp4": nvfp4,
    }


DEVICE_FORMATS = [
    "fp4_e2m1", "fp8_e4m3", "int8@row", "nvfp4", "fp8_e4m3@block128",
    "mxfp4", "fp8_e4m3@tile128", "fp4_e2m1@tile128+sr",
]  # fmt: skip
"""The formats :func:`run` times: the per-tensor, per-row, NVFP4 and 128x128 kernels of issue
22 item 5, and two of the fused 1-row-block kernel beside them."""


def device_seconds(fn, device: torch.device, iters: int) -> tuple[float, float]:
    """(seconds per call, host seconds per call) of ``fn`` over ``iters`` calls after two
    warm-up calls, best of three: on a GPU the first from CUDA events (queued launches overlap
    as in training), the second the time the host took to issue the calls — as long as the
    first when the host, not the GPU, sets the pace. On CPU both are the wall time."""
    fn(), fn()
    best = host = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host = min(host, (time.perf_counter() - t0) / iters)
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / iters)
        else:
            best = host
    return best, host


def run(
    device, size: tuple[int, int] = (8192, 8192), formats=None, dtypes=None, iters: int = 20,
    budget_s: float = 50.0,
) -> list[dict]:
    """One row per (format, dtype): ``fake_quant`` on ``device`` against ``clone()`` of the
    same tensor, and whether it equals the torch reference run on CPU bit for bit (``None``
    for ``+sr``, whose GPU stream differs by design), and ``host_ms``: the host's time to
    issue one call (about ``ms`` when the host, not the GPU, sets the pace). Rows stop being added after
    ``budget_s`` seconds (the ones left get ``"skipped": True``)."""
    device = torch.device(device)
    formats = DEVICE_FORMATS if formats is None else formats
    dtypes = (torch.float32, torch.bfloat16) if dtypes is None else dtypes
    t_start, rows = time.perf_counter(), []
    for dtype in dtypes:
        x_cpu = torch.randn(size, generator=torch.Generator().manual_seed(0)).to(dtype)
        x = x_cpu.to(device)
        gbytes = x.numel() * x.element_size() / 1e9
        clone_s = device_seconds(lambda x=x: x.clone(), device, iters)[0]
        for name in formats:
            row = {"format": name, "dtype": str(dtype).removeprefix("torch."), "device": str(device)}
            rows.append(row)
            if time.perf_counter() - t_start > budget_s:
                row["skipped"] = True
                continue
            seconds, host = device_seconds(lambda x=x, name=name: fake_quant(x, name), device,
                                           iters)
            same = None
            if not get_format(name).stochastic:
                same = torch.equal(fake_quant(x, name).cpu().view(torch.uint8),
                                   fake_quant_2d(x_cpu, get_format(name)).view(torch.uint8))
            row.update(ms=seconds * 1e3, host_ms=host * 1e3, gb_per_s=gbytes / seconds,
                       x_clone=seconds / clone_s, clone_ms=clone_s * 1e3,
                       bit_identical=same)  # fmt: skip
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device is not None:
        formats = DEVICE_FORMATS if args.formats == DEFAULT_FORMATS else args.formats
        for row in run(args.device, (args.size, args.size), formats, iters=args.repeat * 4):
            print(json.dumps(row))
        return
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.size, args.size, generator=gen)
    gbytes = x.numel() * x.element_size() / 1e9
    clone_s = best_seconds(lambda: x.clone(), args.repeat, args.clock)
    refs = {} if args.no_torchao else torchao_references()

    print(
        f"input {args.size}x{args.size} float32 ({gbytes * 1e3:.0f} MB), "
        f"{torch.get_num_threads()} threads, best of {args.repeat} ({args.clock} time), "
        f"torch {torch.__version__}"
    )
    header = f"{'quantizer':<24}{'ms':>9}{'GB/s':>8}{'x clone':>9}{'vs torchao':>12}  bit-identical"
    print(header)
    print("-" * len(header))
    print(f"{'clone()':<24}{clone_s * 1e3:9.1f}{gbytes / clone_s:8.2f}{1.0:9.2f}")
    # all of ours first, then torchao: a run of torchao's emulation leaves the allocator
    # and page cache in a state that makes later large allocations cheaper, which would
    # flatter whatever is timed after it
    ours = {
        name: best_seconds(lambda name=name: fake_quant(x, name), args.repeat, args.clock)
        for name in args.formats
    }
    theirs, same = {}, {}
    for name, ref in refs.items():
        if name in ours:
            theirs[name] = best_seconds(
                lambda ref=ref: ref(x), max(1, args.repeat // 2), args.clock
            )
            bits_equal = torch.equal(
                fake_quant(x, name).view(torch.int32), ref(x).view(torch.int32)
            )
            same[name] = "yes" if bits_equal else "NO"
    for name, seconds in ours.items():
        speedup = f"{theirs[name] / seconds:11.1f}x" if name in theirs else ""
        print(
            f"{name:<24}{seconds * 1e3:9.1f}{gbytes / seconds:8.2f}{seconds / clone_s:9.2f}"
            f"{speedup:>12}  {same.get(name, '')}"
        )
    for name, seconds in theirs.items():
        print(
            f"{'torchao ' + name:<24}{seconds * 1e3:9.1f}{gbytes / seconds:8.2f}{seconds / clone_s:9.2f}"
        )
    ratios = [seconds / clone_s for seconds in ours.values()]
    print(f"median x clone over {len(ours)} formats: {statistics.median(ratios):.2f}")
    if args.stored:
        print_stored(x, args, ours)


def print_stored(x: torch.Tensor, args: argparse.Namespace, fake_s: dict) -> None:
    """Times of quantize / dequantize beside fake_quant's, the bytes stored, and whether
    the round trip is fake_quant bit for bit (the same seed for +sr)."""
    header = f"{'stored':<24}{'fake ms':>9}{'quant ms':>10}{'deq ms':>9}{'B/elem':>8}  round trip"
    print(f"\n{header}\n{'-' * len(header)}")
    for name in args.formats:
        qt = quantize(x, name, generator=torch.Generator().manual_seed(0))
        same = torch.equal(
            dequantize(qt).view(torch.int32),
            fake_quant(x, name, generator=torch.Generator().manual_seed(0)).view(torch.int32),
        )
        quant_s = best_seconds(lambda name=name: quantize(x, name), args.repeat, args.clock)
        deq_s = best_seconds(lambda qt=qt: dequantize(qt), args.repeat, args.clock)
        print(
            f"{name:<24}{fake_s[name] * 1e3:9.1f}{quant_s * 1e3:10.1f}{deq_s * 1e3:9.1f}"
            f"{qt.nbytes / x.numel():8.3f}  {'bit-identical' if same else 'DIFFERENT'}"
        )


if __name__ == "__main__":
    main()
