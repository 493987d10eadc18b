"""A hand-made PGQ profile for the recipe, report, tool and plot tests (not a test module).

One layer of the cost test's model (hidden 4, ffn 6 SwiGLU, 2 heads of dim 2, 1 KV group) at
10 tokens a step: (N, K) qkv (8, 4), proj (4, 4), fc1 (12, 4), fc2 (4, 6), so one GEMM costs
2·10·N·K = 640, 320, 960, 480 FLOPs and the 12 linear GEMMs 7200. SQNR ratios of the int8
candidate, thresholds 20 (forward) and 1 (backward) -> margins (min SQNR / threshold):

    qkv   fprop 100/20 = 5     dgrad 0.5             wgrad 2
    proj  fprop 10/20 = 0.5    dgrad 500 (dy exact)  wgrad 3
    fc1   fprop 40/20 = 2      dgrad 4               wgrad 0.8
    fc2   fprop 400/20 = 20    dgrad 1.5             wgrad 1

Intensities (FLOP/B): qkv 300, proj 100, fc1 400, fc2 250 (H100's ridge: 989/3.35 = 295).
"""

import dataclasses
import math

from megatron_ext.methods.pgq.profile import Profile, gemm_list
from megatron_ext.methods.pgq.sqnr import CANDIDATES
from megatron_ext.precision.cost import ModelShape

SHAPE = ModelShape(num_layers=1, hidden_size=4, ffn_hidden_size=6, num_attention_heads=2,
                   num_query_groups=1, swiglu=True, tokens=10, seq_length=5, vocab_size=8)
GEMM_FLOPS = {"qkv": 640, "proj": 320, "fc1": 960, "fc2": 480}
TOTAL = 7200
SQNR = {
    "L0.qkv.fprop": {"x": 100, "w": 1000}, "L0.qkv.dgrad": {"dy": 0.5, "w": 1000},
    "L0.qkv.wgrad": {"dy": 2, "x": 100},
    "L0.proj.fprop": {"x": 30, "w": 10}, "L0.proj.dgrad": {"dy": math.inf, "w": 500},
    "L0.proj.wgrad": {"dy": 3, "x": 8},
    "L0.fc1.fprop": {"x": 40, "w": 50}, "L0.fc1.dgrad": {"dy": 4, "w": 90},
    "L0.fc1.wgrad": {"dy": 0.8, "x": 60},
    "L0.fc2.fprop": {"x": 400, "w": 900}, "L0.fc2.dgrad": {"dy": 1.5, "w": 70},
    "L0.fc2.wgrad": {"dy": 1.0, "x": 80},
    "embedding.fprop": {"w": 0.06}, "embedding.wgrad": {"dy": 50},
    "logits.fprop": {"x": math.inf, "w": math.inf}, "logits.dgrad": {"dy": 0.08, "w": 300},
    "logits.wgrad": {"dy": 0.3, "x": 200},
}
INTENSITY = {"qkv": 300, "proj": 100, "fc1": 400, "fc2": 250}


def synthetic_profile() -> Profile:
    gemms = []
    for g in gemm_list(SHAPE, micro_tokens=5, tp=1):
        ops = {role: dataclasses.replace(op, sqnr={"int8": SQNR[g.name][role]})
               for role, op in g.operands.items()}
        intensity = INTENSITY.get(g.site.split(".")[-1], g.intensity)
        gemms.append(dataclasses.replace(g, operands=ops, intensity=intensity))
    model = {**dataclasses.asdict(SHAPE), "micro_tokens": 5, "tp": 1, "pp": 1, "dp": 1,
             "sequence_parallel": False}
    return Profile(0, 1, (2.5,), model, {"int8": CANDIDATES["int8"].to_dict()}, tuple(gemms))
