"""One AdamW step of quantized parameters: the torch path (every device, batched over the
parameters of a group) and the dispatch to the fused Triton kernel on CUDA.

**Torch path** (:func:`torch_steps`): the parameters of one group that share their stored
width, their new width and their step count are stepped together. Their ``m``, ``v`` are
dequantized at once into one zero-padded ``(blocks, B)`` tensor each (their codes and scales
concatenated: blocks are independent), the parameters and gradients are copied into the same
block layout, **torch's own functional AdamW** runs once over the whole buffers, and the new
``m``, ``v`` are quantized at once and split per parameter. Every op is elementwise or per
block, so this is bit for bit the same as stepping each parameter alone (the padding stays
zero: ``m = v = p = g = 0`` is a fixed point of the update). A few large ops in place of ~60
small ones per parameter.

**Fused kernels**, one call per parameter, codes bit for bit the torch path's, the parameter
within an ulp (see there): :mod:`.triton_step` on CUDA, :mod:`.cpu_step` (compiled C++) on
CPU unless ``--stquant-cpu-kernel torch``.
"""

from __future__ import annotations

import functools
import struct
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch.optim.adam import adam as torch_adam

from megatron_ext.methods.stquant import cpu_step
from megatron_ext.methods.stquant.quantizer import (QState, _blocks, dequantize_blocks,
                                                    quantize_blocks)

try:
    from megatron_ext.methods.stquant import triton_step
except ImportError:  # no triton: the torch path runs on every device
    triton_step = None

__all__ = ["StepScalars", "adam_", "torch_steps", "update_quantized"]


def adam_(group: dict, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
    """``torch.optim.AdamW``'s update of one group's tensors (torch's functional code)."""
    if group.get("amsgrad", False):
        raise ValueError("STQuant's AdamW does not implement amsgrad")
    beta1, beta2 = group["betas"]
    torch_adam(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, has_complex=False,
        beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=group.get("maximize", False), foreach=group.get("foreach"),
        capturable=group.get("capturable", False),
        differentiable=group.get("differentiable", False), fused=group.get("fused"),
        decoupled_weight_decay=group.get("decoupled_weight_decay",
                                         group.get("adam_w_mode", True)))


@dataclass(frozen=True)
class StepScalars:
    """The float32 constants of one AdamW step, computed (in float64, then rounded to
    float32) as torch's single-tensor AdamW computes its Python scalars."""

    decay: float
    """``1 - lr * weight_decay`` (1 without weight decay)."""
    lerp_weight: float
    """``1 - beta1``, the ``lerp`` weight of ``m``."""
    beta2: float
    """``beta2``, the factor of ``v``."""
    one_minus_beta2: float
    """``1 - beta2``, the ``addcmul`` value."""
    bias2_sqrt: float
    """``sqrt(1 - beta2**t)``."""
    eps: float
    """``eps``."""
    neg_step_size: float
    """``-lr / (1 - beta1**t)``, the ``addcdiv`` value."""

    @classmethod
    def of(cls, group: dict, step: float) -> "StepScalars":
        """The constants of step ``step`` (already incremented) of ``group``."""
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        values = (1 - lr * wd if wd != 0 else 1.0, 1 - beta1, beta2, 1 - beta2,
                  (1 - beta2 ** step) ** 0.5, group["eps"], -(lr / (1 - beta1 ** step)))
        return cls(*(struct.unpack("f", struct.pack("f", x))[0] for x in values))


def fused_step(group: dict, p: torch.Tensor, block: int, old: int, new: int,
               cpu_kernel: str) -> Callable | None:
    """The fused step that takes the update of ``p`` (with its ``.grad``) — ``f(p, grad, m,
    v, bits, scalars)`` — or None for the torch path: the Triton kernel on CUDA, the compiled kernel on CPU when
    ``cpu_kernel`` (``--stquant-cpu-kernel``) gives one; plain AdamW settings only."""
    plain = not any(group.get(k, False) for k in ("maximize", "capturable", "differentiable"))
    if not plain or not isinstance(group["lr"], float):
        return None
    if p.is_cuda:
        takes = triton_step is not None and triton_step.supports(p, block, old, new)
        return triton_step.step if takes else None
    if (p.device.type != "cpu" or p.dtype != torch.float32 or p.grad.dtype != torch.float32
            or (old, new) == (32, 32)):
        return None
    module = cpu_step.kernel(cpu_kernel)
    return None if module is None else functools.partial(cpu_step.step, module)


def update_quantized(group: dict, items: list, block: int, cpu_kernel: str = "torch") -> None:
    """Step the quantized parameters ``items`` (``(p, state, bits)``, ``bits`` the width to
    store at) of one group: a fused kernel where one applies (:func:`fused_step`), else the
    torch path, batched by (stored width, new width, step count, device)."""
    batches = defaultdict(list)
    for p, state, bits in items:
        m_q, v_q = state["exp_avg"], state["exp_avg_sq"]
        fused = fused_step(group, p, block, m_q.bits, bits, cpu_kernel)
        if fused is not None:
            state["step"] += 1
            scalars = StepScalars.of(group, state["step"].item())
            state["exp_avg"], state["exp_avg_sq"] = fused(
                p.view(-1), p.grad.view(-1), m_q, v_q, bits, scalars)
        else:
            batches[m_q.bits, bits, state["step"].item(), p.device].append((p, state))
    for (_, bits, _, _), batch in batches.items():
        states = [s for _, s in batch]
        new = torch_steps(group, [p for p, _ in batch], [p.grad for p, _ in batch],
                          [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                          bits, [s["step"] for s in states])
        for state, (m_q, v_q) in zip(states, new):
            state["exp_avg"], state["exp_avg_sq"] = m_q, v_q


def torch_steps(group: dict, params: list, grads: list, ms: list, vs: list, bits: int,
                steps: list) -> list[tuple[QState, QState]]:
    """The torch path for parameters with the same stored width and step count (module
    docstring): updates ``params`` in place, increments ``steps``, returns each one's new
    ``(m, v)`` at ``bits`` bits (at 32 bits both ways: AdamW in place on the float32 state)."""
    if ms[0].bits == 32 and bits == 32:
        adam_(group, [p.view(-1) for p in params], [g.view(-1) for g in grads],
              [m.codes for m in ms], [v.codes for v in vs], steps)
        return list(zip(ms, vs))
    m, v = _joined_values(ms), _joined_values(vs)
    p, g = _joined(params, ms, m), _joined(grads, ms, m)
    adam_(group, [p.view(-1)], [g.view(-1)], [m.view(-1)], [v.view(-1)], steps[:1])
    for step in steps[1:]:
        step += 1
    for param, part in zip(params, _parts(p, ms)):
        param.view(-1).copy_(part)
    m_all = quantize_blocks(m, "linear", bits, m.numel(), 0)
    v_all = quantize_blocks(v, "log", bits, v.numel(), 0)
    return list(zip(_split(m_all, ms), _split(v_all, vs)))


def _block_counts(qs: list[QState]) -> list[int]:
    return [-(-(q.lead + q.numel) // q.block) for q in qs]


def _joined_values(qs: list[QState]) -> torch.Tensor:
    """The values of every QState in ``qs`` (one mode and width) in one zero-padded
    ``(blocks, B)`` float32 tensor, one after the other."""
    q = qs[0]
    if q.bits == 32:
        return torch.cat([_blocks(q.codes, q.block, q.lead) for q in qs])
    codes = torch.cat([q.codes for q in qs]) if len(qs) > 1 else q.codes
    scales = torch.cat([q.scales for q in qs]) if len(qs) > 1 else q.scales
    return dequantize_blocks(replace(q, numel=codes.shape[0] * q.block, lead=0, codes=codes,
                                     scales=scales))


def _parts(joined: torch.Tensor, qs: list[QState]) -> list[torch.Tensor]:
    """Each QState's range of elements in the joined block layout (views)."""
    flat, parts, start = joined.view(-1), [], 0
    for q, count in zip(qs, _block_counts(qs)):
        parts.append(flat[start + q.lead:start + q.lead + q.numel])
        start += count * q.block
    return parts


def _joined(tensors: list, qs: list[QState], like: torch.Tensor) -> torch.Tensor:
    """``tensors`` (one per QState, its numel) placed in the joined zero-padded layout."""
    out = torch.zeros_like(like)
    for part, t in zip(_parts(out, qs), tensors):
        part.copy_(t.view(-1))
    return out


def _split(joined: QState, like: list[QState]) -> list[QState]:
    """The joined QState cut back into one per parameter (copies: a checkpoint of one must
    not carry the others' storage)."""
    if joined.bits == 32:
        values = [part.clone() for part in _parts(joined.codes.view(-1, like[0].block), like)]
        return [replace(q, mode=joined.mode, bits=32, codes=x, scales=None)
                for q, x in zip(like, values)]
    out, start = [], 0
    for q, count in zip(like, _block_counts(like)):
        rows = slice(start, start + count)
        out.append(replace(q, mode=joined.mode, bits=joined.bits,
                           codes=joined.codes[rows].clone(), scales=joined.scales[rows].clone()))
        start += count
    return out
