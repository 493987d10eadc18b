"""SNIP §4.3.2: the AdamW term that turns a gradient error into a weight error.

AdamW's update of one weight is ``h(g) = α · √(1-β2^t)/(1-β1^t) · m_t / (√v_t + ε)`` with
``m_t = β1 m + (1-β1) g`` and ``v_t = β2 v + (1-β2) g²``. Its derivative in ``g``, element by
element, is

    ∂h/∂g = α c · A,   A = (1-β1)/(√v_t+ε) - (1-β2)·m_t·g / (√v_t (√v_t+ε)²),
    c = √(1-β2^t)/(1-β1^t),

so (Theorem 4.1) a gradient error ``δg`` moves the weight by about
``α c ‖A‖_F ‖δg‖_F / √(NK)``. After a normal optimizer step this module reads ``m_t``, ``v_t``
and ``g`` from megatron's optimizer state and returns ``‖A‖_F²`` per site weight (a sum over
the elements this rank's optimizer owns: with the distributed optimizer shards are disjoint
over DP, otherwise the state is replicated and counted 1/DP), plus ``α``, ``β1``, ``β2``,
``t``, ``ε``.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state


def _groups(optimizer):
    """(model params, main params, distributed?) group lists of a megatron optimizer."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            pairs = [(opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                     (opt.model_fp32_groups, opt.shard_fp32_groups)]
            yield opt, pairs, True
        elif hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            pairs = [(opt.float16_groups, opt.fp32_from_float16_groups),
                     (opt.fp32_from_fp32_groups, opt.fp32_from_fp32_groups)]
            yield opt, pairs, False
        else:  # FP32Optimizer: the model params are the main params
            groups = [g["params"] for g in opt.optimizer.param_groups]
            yield opt, [(groups, groups)], False


def _a_term(main: torch.Tensor, state: dict, beta1: float, beta2: float, eps: float):
    m, v, g = state["exp_avg"].double(), state["exp_avg_sq"].double(), main.grad.double()
    root = v.sqrt()
    a = (1 - beta1) / (root + eps) - (1 - beta2) * m * g / (root.clamp(min=1e-30)
                                                           * (root + eps) ** 2)
    return float(a.square().sum())


def adam_terms(optimizer, site_of_param: dict[int, str]) -> tuple[dict[str, float], dict]:
    """``({site: ‖A‖² share of this rank}, {"lr", "beta1", "beta2", "step", "eps"})``.

    ``site_of_param`` maps ``id(weight)`` of each site's model parameter to its site id.
    """
    sums: dict[str, float] = {}
    hyper = None
    dp = parallel_state.get_data_parallel_world_size()
    for opt, pairs, distributed in _groups(optimizer):
        inner = opt.optimizer
        group = inner.param_groups[0]
        beta1, beta2 = group["betas"]
        for model_groups, main_groups in pairs:
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main in zip(model_group, main_group):
                    site = site_of_param.get(id(model_param))
                    state = inner.state.get(main)
                    if site is None or not state or main.grad is None:
                        continue
                    share = _a_term(main, state, beta1, beta2, group["eps"])
                    sums[site] = sums.get(site, 0.0) + share * (1.0 if distributed else 1 / dp)
                    step = state.get("step", 0)
                    hyper = {"lr": group["lr"], "beta1": beta1, "beta2": beta2,
                             "eps": group["eps"], "step": float(step)}
    return sums, hyper or {}
