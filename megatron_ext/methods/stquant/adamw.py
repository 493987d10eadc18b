"""AdamW whose moments are stored quantized, at a width per layer (STQuant Algorithm 1 lines 18-25).

:class:`QuantizedAdamW` is a ``torch.optim.Optimizer`` that takes the place of the torch
AdamW inside a megatron optimizer. For each parameter it holds ``m`` and ``v`` as
:class:`~megatron_ext.methods.stquant.quantizer.QState` (linear / logarithmic blockwise codes,
or float32 at 32 bits). A step, per parameter:

1. dequantize ``m``, ``v`` into float32 temporaries (no copy at 32 bits: the update is in
   place);
2. run **torch's own functional AdamW** (``torch.optim.adam.adam`` with decoupled weight
   decay: the exact code ``torch.optim.AdamW.step`` runs) on the parameter with them;
3. quantize the new ``m_t``, ``v_t`` at the layer's current width — which may differ from the
   one they were stored at, so a width change costs nothing extra.

The update in step 2 uses the fresh float32 ``m_t``, ``v_t``, as bitsandbytes' and torchao's
8-/4-bit optimizers do; Algorithm 1 (lines 21-24) updates with the re-dequantized ``m̂_t``,
``v̂_t``, which only adds this step's quantization error to this step's update. The stored
state — what the next step starts from — is quantized in both. At 32 bits the result is
bit-identical to ``torch.optim.AdamW``. Parameters without a layer (tensors smaller than the
quantization floor) keep ordinary float32 ``exp_avg`` / ``exp_avg_sq`` tensors.

Widths come from a callable (``widths() -> list[int]``, indexed by layer), read once per step:
the allocator (:mod:`.allocator`) changes them between steps, a test can fix them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.optim.adam import adam as torch_adam

from megatron_ext.methods.stquant.quantizer import (QState, dequantize, dequantize_blocks,
                                                    quantize, quantize_blocks)

try:
    from megatron_ext.methods.stquant import triton_step
except ImportError:  # no triton: the torch path runs on every device
    triton_step = None


@dataclass(frozen=True)
class Slot:
    """Where one (main) parameter sits in STQuant's allocation."""

    layer: int | None
    """Index of its layer in the widths list; None keeps its state float32."""
    lead: int = 0
    """Offset of its first element inside its quantization block (shard start mod block)."""


def _adam(group: dict, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
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


def _kernel_takes(group: dict, p: torch.Tensor, block: int, old: int, new: int) -> bool:
    """Whether the fused Triton step applies (plain AdamW settings, a CUDA parameter)."""
    plain = not any(group.get(k, False) for k in ("maximize", "capturable", "differentiable"))
    return (triton_step is not None and plain and isinstance(group["lr"], float)
            and triton_step.supports(p, block, old, new))


def torch_step(group: dict, p: torch.Tensor, grad: torch.Tensor, m_q: QState, v_q: QState,
               bits: int, step: torch.Tensor) -> tuple[QState, QState]:
    """The torch path of one parameter's update (every device): ``m``, ``v`` dequantized
    into zero-padded blocks, torch's AdamW on their parameter range, requantized from the
    blocks; returns the new ``m``, ``v`` (at 32 bits both ways: AdamW in place)."""
    if m_q.bits == 32 and bits == 32:
        _adam(group, [p.view(-1)], [grad.view(-1)], [m_q.codes], [v_q.codes], [step])
        return m_q, v_q
    m, v = dequantize_blocks(m_q), dequantize_blocks(v_q)
    n = slice(m_q.lead, m_q.lead + m_q.numel)
    _adam(group, [p.view(-1)], [grad.view(-1)], [m.view(-1)[n]], [v.view(-1)[n]], [step])
    return (quantize_blocks(m, "linear", bits, m_q.numel, m_q.lead),
            quantize_blocks(v, "log", bits, m_q.numel, m_q.lead))


class QuantizedAdamW(torch.optim.Optimizer):
    """AdamW with ``m`` / ``v`` stored as blockwise codes at a width per layer."""

    def __init__(self, params, slots: dict, widths: Callable[[], Sequence[int]], block: int = 64,
                 lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=False, foreach=None, capturable=False, differentiable=False,
                        fused=None, decoupled_weight_decay=True)
        super().__init__(params, defaults)
        self.slots = slots
        """``{param: Slot}``; a parameter not in it keeps float32 state."""
        self.widths = widths
        self.block = block

    @classmethod
    def replacing(cls, inner: torch.optim.Optimizer, slots: dict, widths, block: int):
        """Take over ``inner``'s parameter groups — the same dict objects, so megatron's
        references to them and the LR scheduler's writes stay valid. ``inner`` must not have
        stepped yet."""
        if any(inner.state.values()):
            raise ValueError("the optimizer being replaced already has state")
        new = cls([{"params": []}], slots, widths, block)
        new.defaults = dict(inner.defaults)
        new.param_groups = inner.param_groups
        return new

    def _slot(self, p: torch.Tensor) -> Slot | None:
        slot = self.slots.get(p)
        return slot if slot is not None and slot.layer is not None else None

    def _init_state(self, p: torch.Tensor, state: dict, widths: Sequence[int]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        slot = self._slot(p)
        if slot is None:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return
        zeros = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        bits = widths[slot.layer]
        state["exp_avg"] = quantize(zeros, "linear", bits, self.block, slot.lead)
        state["exp_avg_sq"] = quantize(zeros, "log", bits, self.block, slot.lead)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        widths = list(self.widths())
        for group in self.param_groups:
            plain: tuple[list, ...] = ([], [], [], [], [])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state, widths)
                slot = self._slot(p)
                if slot is None:
                    for bucket, value in zip(plain, (p, p.grad, state["exp_avg"],
                                                     state["exp_avg_sq"], state["step"])):
                        bucket.append(value)
                else:
                    self._quantized_update(group, p, state, widths[slot.layer], slot.lead)
            if plain[0]:
                _adam(group, *plain)
        return loss

    def _quantized_update(self, group: dict, p, state: dict, bits: int, lead: int) -> None:
        m_q, v_q = state["exp_avg"], state["exp_avg_sq"]
        if _kernel_takes(group, p, self.block, m_q.bits, bits):
            state["step"] += 1
            scalars = StepScalars.of(group, state["step"].item())
            state["exp_avg"], state["exp_avg_sq"] = triton_step.step(
                p.view(-1), p.grad.view(-1), m_q, v_q, bits, scalars)
        else:
            state["exp_avg"], state["exp_avg_sq"] = torch_step(group, p, p.grad, m_q, v_q,
                                                               bits, state["step"])

    def dequantized_state(self, p: torch.Tensor) -> dict | None:
        """``exp_avg``, ``exp_avg_sq`` (float32, shaped like ``p``) and ``step``; None
        before ``p``'s first step (``megatron_ext.training.optimizer.adam_moments``)."""
        state = self.state.get(p)
        if not state:
            return None
        if self._slot(p) is None:
            return dict(state)
        return {"exp_avg": dequantize(state["exp_avg"]).view_as(p),
                "exp_avg_sq": dequantize(state["exp_avg_sq"]).view_as(p), "step": state["step"]}

    def state_nbytes(self, p: torch.Tensor) -> int:
        """Bytes ``p``'s moments occupy (codes + scales, or the float32 tensors)."""
        state = self.state.get(p)
        if not state:
            return 0
        return sum(q.nbytes() if isinstance(q, QState) else q.numel() * q.element_size()
                   for q in (state["exp_avg"], state["exp_avg_sq"]))
