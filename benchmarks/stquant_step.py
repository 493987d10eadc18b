"""Optimizer step time of STQuant's ``QuantizedAdamW`` against torch's AdamW on one device,
at a Llama shape (default: TinyLlama-1.1B's widths with 8 layers, 0.48 B parameters), and
the fused step checked against the torch path on CPU.

    python benchmarks/stquant_step.py --device cuda          # the GPU table (< 60 s on an H100)
    python benchmarks/stquant_step.py --device cpu --layers 4 --hidden-size 128 \\
        --ffn-hidden-size 352 --vocab-size 256            # the tiny Llama's tensors

Every parameter of at least 4096 elements is quantized at the row's width (4 / 8 / 16 bits),
the others keep float32 state, as ``--optimizer stquant-adamw`` does. On CUDA the update runs
as one Triton kernel per parameter (``methods/stquant/triton_step.py``); on CPU, the torch
path. Times: mean of ``--iters`` steps after two warm-up steps (the first builds the state),
best of three (CUDA events on a GPU). The check row runs one step of a 1 M-element tensor per
width change on the device and the torch path on CPU and compares codes, scales and the
parameter.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ext.methods.stquant.adamw import QuantizedAdamW, Slot  # noqa: E402
from megatron_ext.methods.stquant.update import StepScalars, fused_step, torch_steps  # noqa: E402
from megatron_ext.methods.stquant.quantizer import quantize  # noqa: E402

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
"""AdamW settings of every row."""

DEFAULT_NAMES = ("adamw", "adamw-fused", "stquant-8", "stquant-4", "stquant-16")
"""The rows without ``--optimizers``."""

MIN_NUMEL = 4096
"""Smallest parameter STQuant quantizes (``--stquant-min-numel``'s default)."""


def llama_shapes(layers: int, hidden: int, ffn: int, vocab: int, heads: int = 32,
                 groups: int = 4) -> list[tuple[int, ...]]:
    """Parameter shapes of a Llama (untied embeddings, SwiGLU, grouped-query attention)."""
    kv = 2 * hidden // heads * groups
    layer = [(hidden + kv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn),
             (hidden,), (hidden,)]
    return [(vocab, hidden)] + layer * layers + [(hidden,), (vocab, hidden)]


def make_params(shapes, device) -> list[torch.Tensor]:
    """float32 parameters with small random gradients (seeded)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.randn(shape, device=device, generator=gen) * 0.02
        p.grad = torch.randn(shape, device=device, generator=gen) * 1e-3
        params.append(p)
    return params


def optimizer(name: str, params):
    """``adamw`` (torch's default implementation), ``adamw-fused``, ``stquant-<bits>`` (on
    CPU the compiled kernel) or ``stquant-<bits>-torch`` (the torch path)."""
    if name.startswith("adamw"):
        return torch.optim.AdamW(params, fused=name == "adamw-fused" or None, **HYPER)
    bits = int(name.split("-")[1])
    slots = {p: Slot(i) for i, p in enumerate(params) if p.numel() >= MIN_NUMEL}
    kernel = "torch" if name.endswith("-torch") else "compiled"
    return QuantizedAdamW(params, slots, lambda: [bits] * len(params), **HYPER,
                          cpu_kernel=kernel)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock``: wall time, or this process's CPU time (on a loaded CPU machine)."""


def step_seconds(opt, device: torch.device, iters: int, clock: str = "wall") -> float:
    """Mean seconds per ``opt.step()`` after two warm-up steps, best of three."""
    opt.step(), opt.step()
    best, now = float("inf"), CLOCKS[clock]
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = now()
        for _ in range(iters):
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (now() - t0) / iters)
    return best


def check_rows(device: torch.device, numel: int = 1 << 20) -> list[dict]:
    """One fused step per width change on ``device`` (Triton on CUDA, the compiled kernel on
    CPU) against the torch path on CPU: codes and scales equal, and the parameter's largest
    difference in units of its update."""
    group = dict(HYPER, amsgrad=False, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=True)
    rows = []
    for old, new, lead in [(8, 8, 0), (4, 4, 37), (16, 16, 0), (4, 8, 0), (32, 4, 5)]:
        gen = torch.Generator().manual_seed(old * 100 + new)
        p, g = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 1e-3
        m_q = quantize(torch.randn(numel, generator=gen) * 1e-3, "linear", old, 64, lead)
        v_q = quantize(torch.rand(numel, generator=gen) * 1e-6, "log", old, 64, lead)
        p_ref = p.clone()
        (m_ref, v_ref), = torch_steps(group, [p_ref], [g], [m_q], [v_q], new, [torch.tensor(3.0)])
        p_dev = p.to(device, copy=True)  # p itself stays the step's input
        opt_state = [_to(q, device) for q in (m_q, v_q)]
        p_dev.grad = g.to(device)
        fused = fused_step(group, p_dev, 64, old, new, "compiled")
        got = fused(p_dev, p_dev.grad, *opt_state, new, StepScalars.of(group, 4.0))
        same = all(torch.equal(a.codes.cpu(), b.codes) and (
            a.scales is None or torch.equal(a.scales.cpu(), b.scales)) for a, b in zip(got, (m_ref, v_ref)))
        update = (p_ref.double() - p.double() * (1 - HYPER["lr"] * HYPER["weight_decay"])).abs()
        diff = (p_dev.cpu().double() - p_ref.double()).abs()
        ulp = (torch.nextafter(p_ref.abs(), torch.tensor(float("inf"))) - p_ref.abs()).double()
        rows.append({"operation": f"stquant check {old}->{new} bits, lead {lead}",
                     "device": str(device), "codes_bit_identical": same,
                     "param_bit_identical": bool(diff.max() == 0),
                     "param_within_ulp_tolerance": bool((diff <= ulp + update * 2**-21).all()),
                     "param_max_diff_over_update": float((diff / update.clamp(min=1e-30)).max()),
                     "param_elements_differing": int((diff > 0).sum())})
    return rows


def _to(q, device):
    """A copy of the QState ``q`` on ``device``."""
    from dataclasses import replace
    return replace(q, codes=q.codes.to(device),
                   scales=None if q.scales is None else q.scales.to(device))


def run(device, layers: int = 8, hidden: int = 2048, ffn: int = 5632, vocab: int = 32000,
        names=DEFAULT_NAMES,
        iters: int = 5, check_numel: int = 1 << 20, clock: str = "wall") -> list[dict]:
    """One row per optimizer (ms per step, GB/s of parameters stepped, ratio to ``adamw``
    and to ``adamw-fused``), then the check rows (``check_numel`` elements each; 0: none)."""
    device = torch.device(device)
    shapes = llama_shapes(layers, hidden, ffn, vocab)
    numel = sum(torch.Size(s).numel() for s in shapes)
    times = {}
    for name in names:
        if name == "adamw-fused" and device.type != "cuda":
            continue
        params = make_params(shapes, device)
        times[name] = step_seconds(optimizer(name, params), device, iters, clock)
        del params
    base = times.get("adamw")
    rows = [{"operation": f"optimizer step {name}", "device": str(device), "params": numel,
             "ms": t * 1e3, "gb_per_s": numel * 4 / t / 1e9,
             "x_adamw": t / base if base else None,
             "x_adamw_fused": t / times["adamw-fused"] if "adamw-fused" in times else None}
            for name, t in times.items()]
    return rows + (check_rows(device, check_numel) if check_numel else [])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="device to time on (default cuda)")
    p.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    p.add_argument("--hidden-size", type=int, default=2048, help="hidden size (default 2048)")
    p.add_argument("--ffn-hidden-size", type=int, default=5632, help="FFN size (default 5632)")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per round (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    p.add_argument("--no-check", action="store_true", help="skip the check rows")
    p.add_argument("--clock", choices=list(CLOCKS), default="wall",
                   help="wall time (default) or this process's CPU time (CPU, loaded machine)")
    p.add_argument("--optimizers", nargs="+", default=None, metavar="NAME",
                   help="rows: adamw, adamw-fused, stquant-<bits>, stquant-<bits>-torch "
                        "(default adamw adamw-fused stquant-8 stquant-4 stquant-16)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for row in run(args.device, args.layers, args.hidden_size, args.ffn_hidden_size,
                   args.vocab_size, names=args.optimizers or DEFAULT_NAMES, iters=args.iters,
                   check_numel=0 if args.no_check else 1 << 20, clock=args.clock):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
