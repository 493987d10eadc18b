"""Unit ids, and the norm reduction: TP=2 x PP=2 (x DP=2) shards summed by one simulated
all-reduce give the single-process unit norms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ext.methods.gnmr.decisions import GnmrConfig, GnmrController
from megatron_ext.methods.gnmr.units import (
    local_sq_vector, norms_from_sq, owns_dp_copy, unit_ids, unit_layer, unit_of_site, unit_sites,
    unit_slots)
from megatron_ext.precision.cost import ModelShape
from megatron_ext.sites import SITES, all_site_ids, parse_site_id

LAYERS, TP, PP, DP = 4, 2, 2, 2
SHAPE = ModelShape(LAYERS, hidden_size=8, ffn_hidden_size=12, num_attention_heads=2,
                   num_query_groups=1, swiglu=True, tokens=1)
ROW_PARALLEL = ("proj", "fc2")


def test_unit_ids():
    assert unit_ids(2, "block") == ["L0", "L1"]
    assert unit_ids(1, "site") == ["L0.qkv", "L0.proj", "L0.fc1", "L0.fc2"]
    assert unit_of_site("L3.fc1", "block") == "L3"
    assert unit_of_site("L3.fc1", "site") == "L3.fc1"
    assert unit_sites("L2") == [f"L2.{s}" for s in SITES]
    assert unit_sites("L2.proj") == ["L2.proj"]
    assert unit_layer("L12") == 12 and unit_layer("L5.fc2") == 5
    for bad in ("L01", "layer3", "L3.fc3"):
        with pytest.raises(ValueError):
            unit_sites(bad)
    with pytest.raises(ValueError, match="granularity"):
        unit_ids(2, "layer")


def grads(rng) -> dict[str, np.ndarray]:
    """One weight gradient per site, with scales that differ by orders of magnitude."""
    return {sid: rng.normal(size=SHAPE.site_nk(parse_site_id(sid)[1])) * 10.0 ** rng.integers(-3, 3)
            for sid in all_site_ids(LAYERS)}


def tp_shard(sid: str, g: np.ndarray, tp_rank: int) -> np.ndarray:
    """Column-parallel weights split by output rows, row-parallel ones by input columns."""
    axis = 1 if parse_site_id(sid)[1] in ROW_PARALLEL else 0
    return np.array_split(g, TP, axis=axis)[tp_rank]


def rank_contributions(g: dict, pp: int, tp: int, dp: int, dist_opt: bool) -> dict[str, float]:
    """{site: sum of squares this rank owns} for one (pp, tp, dp) rank."""
    layers = range(pp * LAYERS // PP, (pp + 1) * LAYERS // PP)
    sids = [sid for sid in all_site_ids(LAYERS) if parse_site_id(sid)[0] in layers]
    shards = {sid: tp_shard(sid, g[sid], tp).ravel() for sid in sids}
    if not dist_opt:
        if not owns_dp_copy(dp, False):
            return {}
        return {sid: float(np.sum(s * s)) for sid, s in shards.items()}
    # distributed optimizer: the stage's flat gradient buffer, reduce-scattered over DP into
    # uneven contiguous pieces, so some parameters straddle two DP ranks
    flat = np.concatenate(list(shards.values()))
    owner = np.searchsorted([len(flat) // 3], np.arange(len(flat)), side="right")
    out, start = {}, 0
    for sid, s in shards.items():
        mine = owner[start:start + len(s)] == dp
        out[sid] = float(np.sum(s[mine] ** 2))
        start += len(s)
    assert owns_dp_copy(dp, True)
    return out


@pytest.mark.parametrize("granularity", ["block", "site"])
@pytest.mark.parametrize("dist_opt", [False, True])
def test_sharded_reduction_equals_single_process(granularity, dist_opt):
    rng = np.random.default_rng(7)
    units = unit_ids(LAYERS, granularity)
    g = grads(rng)
    single = np.array([np.sqrt(sum(np.sum(g[s] ** 2) for s in unit_sites(u))) for u in units])
    vectors = [_vector(rank_contributions(g, pp, tp, dp, dist_opt), units, granularity)
               for pp in range(PP) for tp in range(TP) for dp in range(DP)]
    reduced = norms_from_sq(np.sum(vectors, axis=0))  # the all-reduce (sum)
    np.testing.assert_allclose(reduced, single, rtol=1e-13)
    # a stage-0 rank holds nothing of stage 1's units
    stage1 = [i for i, u in enumerate(units) if unit_layer(u) >= LAYERS // PP]
    assert np.all(vectors[0][stage1] == 0) and np.any(vectors[0] > 0)


def test_sharded_and_single_norms_take_the_same_decisions():
    units = unit_ids(LAYERS, "block")
    config = GnmrConfig(lock=3, max_promoted=2, delta=3)
    a, b = (GnmrController.create(config, units, 40) for _ in range(2))
    promoted = 0
    for t in range(1, 41):
        g = grads(np.random.default_rng(1000 + t))
        single = [np.sqrt(sum(np.sum(g[s] ** 2) for s in unit_sites(u))) for u in units]
        vectors = [_vector(rank_contributions(g, pp, tp, dp, True), units, "block")
                   for pp in range(PP) for tp in range(TP) for dp in range(DP)]
        da, db = a.step(t, single), b.step(t, norms_from_sq(np.sum(vectors, axis=0)))
        assert da.promoted == db.promoted
        promoted += len(da.promoted)
    assert promoted > 0


def _vector(local_sq: dict, units, granularity) -> np.ndarray:
    sids = list(local_sq)
    sums = torch.tensor([local_sq[s] for s in sids], dtype=torch.float64)
    return local_sq_vector(sums, unit_slots(sids, units, granularity)).numpy()


def test_local_vector_rejects_foreign_sites():
    with pytest.raises(ValueError, match="no GNMR unit"):
        unit_slots(["L9.fc1"], unit_ids(2, "block"), "block")
    vec = _vector({"L1.fc1": 2.0, "L1.qkv": 3.0}, unit_ids(2, "block"), "block")
    assert vec.tolist() == [0.0, 5.0] and vec.dtype == np.float64


@pytest.mark.parametrize("granularity", ["block", "site"])
def test_local_vector_is_the_sequential_sum_bit_for_bit(granularity):
    """On the device, each unit adds its sites in site order from 0.0: the float64 sums of a
    Python loop over the sites, to the bit (values over 30 orders of magnitude, shuffled)."""
    rng = np.random.default_rng(3)
    units = unit_ids(LAYERS, granularity)
    sids = [s for u in units for s in unit_sites(u)]
    sids = [sids[i] for i in rng.permutation(len(sids))[:-3]]  # some sites held elsewhere
    values = rng.random(len(sids)) * 10.0 ** rng.integers(-15, 15, len(sids))
    loop = np.zeros(len(units))
    for sid, v in zip(sids, values):
        loop[units.index(unit_of_site(sid, granularity))] += v
    got = local_sq_vector(torch.from_numpy(values), unit_slots(sids, units, granularity))
    assert got.numpy().tobytes() == loop.tobytes()
