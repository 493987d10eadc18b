"""torch's fast AdamW kernels and a foreach gradient norm inside megatron-core's optimizer.

Without Transformer Engine or Apex, megatron-core's ``get_megatron_optimizer`` builds a plain
``torch.optim.AdamW`` (``foreach`` / ``fused`` left to torch's defaults: the per-tensor loop
on a CPU) and computes the gradient norm with its local fallbacks
(``megatron.core.utils.local_multi_tensor_l2_norm``: one norm per tensor, each read to the
host to build the list it then reduces; ``local_multi_tensor_scale``: a multiply and a copy
per tensor). Two changes, neither touching the optimizer's maths or its checkpoint:

* **The AdamW kernel** (:func:`adam_kernel`, :func:`use_adam_kernel`): on CUDA torch's fused
  AdamW (one kernel per dtype and device for all parameters), elsewhere torch's foreach AdamW,
  which on a CPU is bit-identical to the per-tensor loop (torch's fused CPU kernel is not: it
  differs by an ulp). The flags live in the inner optimizer's parameter groups; a checkpoint
  stores them with its groups and ``load_state_dict`` puts the saved ones back, so
  :func:`use_adam_kernel` runs again after every load. The state (``step``, ``exp_avg``,
  ``exp_avg_sq``) has the same keys, shapes and dtypes under every kernel; only the 0-d
  ``step`` lives on the parameter's device under the fused kernel, on the host otherwise.
* **The gradient norm and clip** (:func:`use_foreach_grad_norm`): megatron's local
  ``multi_tensor_l2norm`` / ``multi_tensor_scale`` stand-ins in
  ``megatron.core.optimizer.clip_grads`` are replaced by drop-ins built on torch's foreach
  ops: the norm is one ``_foreach_norm`` and one norm of the stacked results, left on the
  device (megatron then reads the all-reduced total once, as with Apex); the clip one
  ``_foreach_mul_``. Only megatron's own fallbacks are replaced: with TE or Apex installed
  their kernels stay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamKernel:
    """Which of torch's AdamW implementations runs (``torch.optim.AdamW``'s flags)."""

    fused: bool
    """One fused kernel over all parameters of a device and dtype (CUDA)."""
    foreach: bool
    """torch's multi-tensor (``_foreach_*``) implementation."""


def adam_kernel(device_type: str) -> AdamKernel:
    """The AdamW kernel for parameters on ``device_type`` (``"cuda"``, ``"cpu"``, ...)."""
    if device_type == "cuda":
        return AdamKernel(fused=True, foreach=False)
    return AdamKernel(fused=False, foreach=True)


def torch_adams(optimizer):
    """Each inner optimizer of ``optimizer`` (megatron's, chained or not) that is exactly torch's
    ``Adam`` / ``AdamW`` — not a subclass or a replacement such as STQuant's."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if type(inner) in (torch.optim.Adam, torch.optim.AdamW):
            yield inner


def step_tensor(group: dict, param: torch.Tensor, value: float) -> torch.Tensor:
    """A 0-d ``step`` state as torch's AdamW allocates it under ``group``'s kernel: float32,
    on ``param``'s device with the fused (or capturable) kernel, else on the host."""
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(value), dtype=torch.float32,
                        device=param.device if on_device else "cpu")


def use_adam_kernel(optimizer, kernel: AdamKernel | None = None) -> AdamKernel | None:
    """Set ``kernel`` (default: :func:`adam_kernel` of the parameters' device) on every inner
    torch AdamW of ``optimizer`` (also after a load: the checkpoint's groups carry their own
    flags), moving any existing ``step`` to where that kernel keeps it. Returns the kernel,
    None if there is no torch AdamW with parameters on this rank."""
    chosen = None
    for inner in torch_adams(optimizer):
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params:
            continue
        chosen = kernel or adam_kernel(params[0].device.type)
        for holder in (inner.defaults, *inner.param_groups):
            holder["fused"], holder["foreach"] = chosen.fused, chosen.foreach
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param)
                if state and "step" in state:
                    state["step"] = step_tensor(group, param, state["step"].item())
    return chosen


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm``: the L2 norm of all tensors of
    ``tensor_lists[0]`` (not empty: megatron asks only then) as a 1-element float32 tensor on
    their device, never read here."""
    norms = torch._foreach_norm(tensor_lists[0], dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for each pair of
    ``tensor_lists[0]`` (src), ``tensor_lists[1]`` (dst); in place when they are the same."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_grad_norm() -> bool:
    """Replace megatron's local gradient-norm and clip fallbacks by the foreach drop-ins
    (module docstring). Idempotent; False (nothing replaced) when TE's or Apex's kernels are
    in use."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    replaced = False
    if clip_grads.l2_norm_impl in (utils.local_multi_tensor_l2_norm, foreach_l2_norm):
        clip_grads.l2_norm_impl = foreach_l2_norm
        replaced = True
    if clip_grads.multi_tensor_scale_impl in (utils.local_multi_tensor_scale, foreach_scale):
        clip_grads.multi_tensor_scale_impl = foreach_scale
        replaced = True
    return replaced
