"""Units (what GNMR promotes as a whole) and how every rank gets every unit's gradient norm.

Units
-----
``--gnmr-granularity block`` (the paper's main setting, §5.2): a unit is one transformer
block, id ``L{i}`` (global 0-based layer index), made of the block's four sites
``L{i}.qkv``, ``L{i}.proj``, ``L{i}.fc1``, ``L{i}.fc2``. ``--gnmr-granularity site``: a unit
is one site, id = the site id (:mod:`megatron_ext.sites`). Unit order is layer order, then
site order, the same on every rank.

The norm reduction
------------------
A unit's norm is the 2-norm of the concatenated weight gradients of its sites, *after* the
data-parallel reduction (the gradient the optimizer applies)::

    n_u^2 = Σ_{site ∈ u} ||∇W_site||_F^2

Squares add over any partition of the elements, so every rank sums the squares of the
elements it owns, puts them in its unit's slot of a ``U``-long float64 vector, and **one**
all-reduce (sum) of that vector over all ranks gives every rank every ``n_u^2`` — whatever
the layout, as long as each element of each reduced gradient is owned by exactly one rank:

* **TP**: column-parallel weights (``qkv``, ``fc1``) are split by output rows, row-parallel
  ones (``proj``, ``fc2``) by input columns; each TP rank owns its shard (disjoint).
* **PP**: a stage holds only its layers; the other units' slots stay 0 on its ranks.
* **DP**: after the reduction every DP replica holds the same gradient, so only DP rank 0
  owns it (:func:`owns_dp_copy`); with the distributed optimizer each DP rank holds the
  reduced values of its own shard of the gradient buffer (a reduce-scatter), and owns those.

The squares should be summed in float64 (``grad.double().square().sum()``) so that the sum
over shards equals the single-process norm to ~1e-16 relative.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import torch

from megatron_ext.sites import SITES, all_site_ids, parse_site_id, site_id

GRANULARITIES = ("block", "site")
"""``--gnmr-granularity`` choices."""

_BLOCK_ID = re.compile(r"L(0|[1-9]\d*)")


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown GNMR granularity {granularity!r}; "
                         f"choose {' or '.join(GRANULARITIES)}")


def unit_ids(num_layers: int, granularity: str) -> list[str]:
    """Every unit of a ``num_layers``-layer model, in order."""
    _check_granularity(granularity)
    if granularity == "site":
        return all_site_ids(num_layers)
    return [f"L{layer}" for layer in range(num_layers)]


def unit_of_site(sid: str, granularity: str) -> str:
    """The unit site ``sid`` belongs to (``"L3.fc1"`` -> ``"L3"`` for blocks)."""
    _check_granularity(granularity)
    layer, _ = parse_site_id(sid)
    return sid if granularity == "site" else f"L{layer}"


def unit_sites(unit: str) -> list[str]:
    """The site ids of a unit (a block id gives its four sites, a site id itself)."""
    match = _BLOCK_ID.fullmatch(unit) if isinstance(unit, str) else None
    if match is not None:
        return [site_id(int(match.group(1)), s) for s in SITES]
    parse_site_id(unit)  # ValueError for anything that is neither
    return [unit]


def unit_layer(unit: str) -> int:
    """The global layer index of a unit."""
    return parse_site_id(unit_sites(unit)[0])[0]


def owns_dp_copy(dp_rank: int, sharded_over_dp: bool) -> bool:
    """Whether this DP rank's gradient values count in the norm (see the module docstring):
    its own shard with the distributed optimizer, else only DP rank 0's full copy."""
    return sharded_over_dp or dp_rank == 0


def unit_slots(sids: Sequence[str], units: Sequence[str], granularity: str) -> torch.Tensor:
    """Where each of a rank's sites adds in the ``len(units)`` vector: a ``[K, U]`` long
    tensor whose row ``k`` holds, for every unit, the index in ``sids`` of its ``k``-th site
    here, or ``len(sids)`` (a zero) where it has fewer (sites of other ranks are absent)."""
    index = {unit: i for i, unit in enumerate(units)}
    members: list[list[int]] = [[] for _ in units]
    for i, sid in enumerate(sids):
        unit = unit_of_site(sid, granularity)
        if unit not in index:
            raise ValueError(f"site {sid} is in no GNMR unit of this run")
        members[index[unit]].append(i)
    depth = max(map(len, members), default=0)
    rows = [[m[k] if k < len(m) else len(sids) for m in members] for k in range(depth)]
    return torch.tensor(rows, dtype=torch.long).view(depth, len(units))


def local_sq_vector(local_sq: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The float64 vector this rank contributes to the all-reduce: ``local_sq[i]``, the sum
    of squares of the gradient elements of site ``i``'s weight this rank owns, added into its
    unit's slot (:func:`unit_slots`, on ``local_sq``'s device). Each unit adds its sites one
    after another from 0.0, in site order, on the device: the float64 sum a loop over the
    sites gives, with no copy to the host and back."""
    padded = torch.cat([local_sq, local_sq.new_zeros(1)])
    out = local_sq.new_zeros(slots.shape[1])
    for row in slots:
        out = out + padded[row]
    return out


def norms_from_sq(total_sq) -> np.ndarray:
    """``n_u`` from the all-reduced squared norms (float64)."""
    return np.sqrt(np.asarray(total_sq, dtype=np.float64))
