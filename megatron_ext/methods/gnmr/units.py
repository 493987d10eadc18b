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
from typing import Mapping, Sequence

import numpy as np

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


def local_sq_vector(local_sq: Mapping[str, float], units: Sequence[str],
                    granularity: str) -> np.ndarray:
    """The ``len(units)`` float64 vector this rank contributes to the all-reduce.

    ``local_sq`` maps site ids to the sum of squares of the gradient elements of that site's
    weight this rank owns (sites this rank does not hold are simply absent)."""
    index = {unit: i for i, unit in enumerate(units)}
    out = np.zeros(len(units), dtype=np.float64)
    for sid, value in local_sq.items():
        unit = unit_of_site(sid, granularity)
        if unit not in index:
            raise ValueError(f"site {sid} is in no GNMR unit of this run")
        out[index[unit]] += float(value)
    return out


def norms_from_sq(total_sq) -> np.ndarray:
    """``n_u`` from the all-reduced squared norms (float64)."""
    return np.sqrt(np.asarray(total_sq, dtype=np.float64))
