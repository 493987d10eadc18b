"""AdamW whose moments are stored quantized, at a width per layer (STQuant Algorithm 1 lines 18-25).

:class:`QuantizedAdamW` is a ``torch.optim.Optimizer`` that takes the place of the torch
AdamW inside a megatron optimizer. For each parameter it holds ``m`` and ``v`` as
:class:`~megatron_ext.methods.stquant.quantizer.QState` (linear / logarithmic blockwise codes,
or float32 at 32 bits). A step, per parameter (in effect):

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

How the step runs (the torch path batched over a group's parameters, or one fused kernel per
parameter: Triton on CUDA, compiled C++ on CPU): :mod:`.update`.

Widths come from a callable (``widths() -> list[int]``, indexed by layer), read once per step:
the allocator (:mod:`.allocator`) changes them between steps, a test can fix them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megatron_ext.methods.stquant.quantizer import QState, dequantize, quantize
from megatron_ext.methods.stquant.update import adam_, update_quantized


@dataclass(frozen=True)
class Slot:
    """Where one (main) parameter sits in STQuant's allocation."""

    layer: int | None
    """Index of its layer in the widths list; None keeps its state float32."""
    lead: int = 0
    """Offset of its first element inside its quantization block (shard start mod block)."""


class QuantizedAdamW(torch.optim.Optimizer):
    """AdamW with ``m`` / ``v`` stored as blockwise codes at a width per layer."""

    def __init__(self, params, slots: dict, widths: Callable[[], Sequence[int]], block: int = 64,
                 lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, cpu_kernel: str = "torch"):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=False, foreach=None, capturable=False, differentiable=False,
                        fused=None, decoupled_weight_decay=True)
        super().__init__(params, defaults)
        self.slots = slots
        """``{param: Slot}``; a parameter not in it keeps float32 state."""
        self.widths = widths
        self.block = block
        self.cpu_kernel = cpu_kernel
        """How CPU parameters step: ``compiled``, ``torch`` or ``auto``
        (``--stquant-cpu-kernel``, :mod:`.cpu_step`)."""

    @classmethod
    def replacing(cls, inner: torch.optim.Optimizer, slots: dict, widths, block: int,
                  cpu_kernel: str = "torch"):
        """Take over ``inner``'s parameter groups — the same dict objects, so megatron's
        references to them and the LR scheduler's writes stay valid. ``inner`` must not have
        stepped yet."""
        if any(inner.state.values()):
            raise ValueError("the optimizer being replaced already has state")
        new = cls([{"params": []}], slots, widths, block, cpu_kernel=cpu_kernel)
        new.defaults = dict(inner.defaults)
        new.param_groups = inner.param_groups
        for group in new.param_groups:  # its steps live on the host: never torch's fused kernel
            group["fused"] = None
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
            quantized = []
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
                    quantized.append((p, state, widths[slot.layer]))
            if plain[0]:
                adam_(group, *plain)
            update_quantized(group, quantized, self.block, self.cpu_kernel)
        return loss

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

    def state_nbytes(self, p: torch.Tensor) -> tuple[int, int]:
        """Bytes ``p``'s moments occupy: (codes — or the float32 tensors —, scales)."""
        state = self.state.get(p)
        if not state:
            return 0, 0
        codes = scales = 0
        for q in (state["exp_avg"], state["exp_avg_sq"]):
            if isinstance(q, QState):
                codes += q.codes.numel() * q.codes.element_size()
                scales += q.nbytes() - q.codes.numel() * q.codes.element_size()
            else:
                codes += q.numel() * q.element_size()
        return codes, scales
