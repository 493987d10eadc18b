"""SNIP §4.3.2: the AdamW term that turns a gradient error into a weight error.

AdamW's update of one weight is ``h(g) = α · √(1-β2^t)/(1-β1^t) · m_t / (√v_t + ε)`` with
``m_t = β1 m + (1-β1) g`` and ``v_t = β2 v + (1-β2) g²``. Its derivative in ``g``, element by
element, is

    ∂h/∂g = α c · A,   A = (1-β1)/(√v_t+ε) - (1-β2)·m_t·g / (√v_t (√v_t+ε)²),
    c = √(1-β2^t)/(1-β1^t),

so a gradient error ``δg`` moves the weight by ``α c ‖A ⊙ δg‖_F``. The paper bounds this by
``α c ‖A‖_F ‖δg‖_F / √(NK)`` (Theorem 4.1, isotropic ``δg``); we keep ``A`` element-wise,
because ``A`` is largest exactly where ``v`` and hence ``g`` and its error are smallest, and
the isotropic product then overstates some sites by orders of magnitude
(:mod:`megatron_ext.methods.snip.divergence`). After a normal optimizer step this module reads
``m_t``, ``v_t`` and ``g`` from megatron's optimizer state (dequantized when the optimizer
stores them quantized, as STQuant does) and returns ``A²`` shaped like
each site's local weight shard (with the distributed optimizer each DP rank holds a slice:
the slices are summed over DP), plus ``α``, ``β1``, ``β2``, ``t``, ``ε``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.training.optimizer import adam_moments, main_params
from megatron_ext.methods.snip.tensor_store import TensorStore


def a_squared(mvg: torch.Tensor, beta1: float, beta2: float, eps: float) -> torch.Tensor:
    """``A²`` (module docstring) from the stacked ``(m_t, v_t, g)``."""
    m, v, g = mvg
    root = v.sqrt()
    a = (1 - beta1) / (root + eps) - (1 - beta2) * m * g / (root.clamp(min=1e-30)
                                                           * (root + eps) ** 2)
    return a.square()


def adam_terms(optimizer, site_params: dict, dtype=torch.float64,
               store: TensorStore | None = None) -> tuple[dict, dict]:
    """``({site: A² like the site's local weight, as a Stored},
    {"lr", "beta1", "beta2", "step", "eps"})``.

    ``site_params`` maps each local site id to its model parameter (the weight). ``A²`` is
    computed in float64 one site at a time (one site's ``m, v, g`` in float64 at most) and
    returned in ``dtype`` (float32 holds half as much, rounded to 2^-24 relative), put in
    ``store`` (:mod:`.tensor_store`; None: kept on the weight's device) as soon as it is made,
    with its sum (``Stored.total``, made on the weight's device).
    """
    site_of = {id(p): sid for sid, p in site_params.items()}
    found: dict[str, list] = {}
    sharded = False
    hyper = None
    for mp in main_params(optimizer):
        inner = mp.sub.optimizer
        group = inner.param_groups[0]
        beta1, beta2 = group["betas"]
        sharded = sharded or mp.distributed
        site = site_of.get(id(mp.model))
        state = adam_moments(inner, mp.main) if site is not None else None
        if not state or mp.main.grad is None:
            continue
        found.setdefault(site, []).append((mp, state))
        hyper = {"lr": group["lr"], "beta1": beta1, "beta2": beta2,
                 "eps": group["eps"], "step": float(state.get("step", 0))}
    hyper = _agree(hyper)
    sites = sorted(site_params) if sharded else list(found)  # sharded: all ranks, same order
    store = store or TensorStore()
    return {sid: store.put(a_squared(_mvg(site_params[sid], found.get(sid, []), sharded),
                                     hyper["beta1"], hyper["beta2"], hyper["eps"]).to(dtype),
                           total=True)
            for sid in sites}, hyper


def _mvg(param: torch.Tensor, pieces: list, sharded: bool) -> torch.Tensor:
    """The stacked float64 ``(m_t, v_t, g)`` of one site's weight; sharded over DP (the
    distributed optimizer): every rank adds its slices, one all-reduce per site."""
    if not sharded:
        (mp, state), = pieces
        return torch.stack([state["exp_avg"].double(), state["exp_avg_sq"].double(),
                            mp.main.grad.double()]).view(3, *param.shape)
    full = torch.zeros(3, param.numel(), dtype=torch.float64, device=param.device)
    for mp, state in pieces:  # this rank's slice of the flattened weight
        end = mp.start + mp.main.numel()
        for row, t in enumerate((state["exp_avg"], state["exp_avg_sq"], mp.main.grad)):
            full[row, mp.start:end] = t.reshape(-1)
    dist.all_reduce(full, group=parallel_state.get_data_parallel_group())
    return full.view(3, *param.shape)


def _agree(hyper: dict | None) -> dict:
    """The hyper-parameters from a rank that has them (a rank may own no site's state)."""
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, hyper)
    return next((h for h in found if h), {})
