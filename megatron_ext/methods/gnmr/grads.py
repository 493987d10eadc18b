"""Every unit's weight-gradient norm on every rank, read from megatron's DDP gradient buffers.

The torch side of :mod:`.units`' norm reduction. A site's weight gradient is its parameter's
``main_grad``: a view into the FP32 gradient buffer of megatron-core's
``DistributedDataParallel``, reduced over DP when the backward of the step ends (megatron's
``finalize_model_grads``), before the optimizer step.

**Which elements this rank owns** (:func:`owned_parts`; each element of each reduced gradient
counts on exactly one rank):

* without the distributed optimizer every DP replica holds the whole reduced gradient of its
  TP shard, and only DP rank 0 counts it (:func:`.units.owns_dp_copy`);
* with it, the reduction is a reduce-scatter: each bucket of the buffer is split into
  ``D`` equal shards and DP rank ``r`` holds reduced values in shard ``r`` only (the rest of
  its buffer holds its own, unreduced micro-batch gradients). A parameter at buffer elements
  ``[start, end)`` owns here the overlap with ``[offset + r·S, offset + (r+1)·S)``, ``S`` =
  bucket size / ``D`` (:func:`shard_overlap`), which may be empty or cut the weight anywhere;
* TP shards and PP stages hold disjoint weights already.

**When.** megatron's optimizer clips in place: with FP32 parameters ``param.grad`` *is*
``main_grad``; with BF16 parameters or the distributed optimizer the FP32 main gradient is
``main_grad.float()`` (or a view of its shard), which for an FP32 buffer is the same memory.
So :class:`NormReader.measure` must run after the backward and before ``optimizer.step()``:
the GNMR extension calls it from a wrapper around ``step`` (``Extension.wrap_optimizer``).

**How.** Per site, the owned part's squares are summed in float64 on the device (a float64
copy of the part, so every element is squared exactly and the sum over shards equals the
one-process sum to ~1e-16 relative, whatever the layout); the per-site sums are added into
their unit's slot on the device (:func:`.units.local_sq_vector`) and
:meth:`NormReader.reduce` sums that ``U``-long float64 vector over the whole world in one
all-reduce: every rank then holds every unit's ``n²`` (the PP stages' slots gathered).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.methods.gnmr.units import (local_sq_vector, norms_from_sq, owns_dp_copy,
                                             unit_slots)
from megatron_ext.precision.layers import quantized_linears
from megatron_ext.training.distributed import device


def shard_overlap(start: int, end: int, bucket_offset: int, bucket_numel: int, rank: int,
                  size: int) -> tuple[int, int]:
    """The part ``[lo, hi)`` of a parameter (buffer elements ``[start, end)``, relative to the
    parameter) that lies in DP rank ``rank``'s shard of its bucket (``bucket_numel``
    elements from ``bucket_offset``, split into ``size`` equal shards); ``(0, 0)`` if none."""
    shard = bucket_numel // size
    lo = max(start, bucket_offset + rank * shard)
    hi = min(end, bucket_offset + (rank + 1) * shard)
    return (lo - start, hi - start) if hi > lo else (0, 0)


def _shard_ranges(chunk) -> dict:
    """Parameter -> its owned element range, for a chunk under the distributed optimizer."""
    ranges = {}
    for buffer in chunk.buffers:
        rank = dist.get_rank(buffer.data_parallel_group)
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            ranges[param] = shard_overlap(start, end, bucket.offset, bucket.grad_data.numel(),
                                          rank, buffer.data_parallel_world_size)
    return ranges


def owned_parts(model: list) -> list[tuple[str, torch.Tensor]]:
    """``(site id, 1-D view of the part of its weight gradient this rank owns)`` for every
    site of this rank's model chunks (module docstring); parts that are empty are left out."""
    parts = []
    for chunk in model:
        sharded = chunk.ddp_config.use_distributed_optimizer
        if not owns_dp_copy(parallel_state.get_data_parallel_rank(), sharded):
            continue
        ranges = _shard_ranges(chunk) if sharded else {}
        for sid, module in quantized_linears(chunk).items():
            grad = module.weight.main_grad.view(-1)
            lo, hi = ranges.get(module.weight, (0, grad.numel()))
            if hi > lo:
                parts.append((sid, grad[lo:hi]))
    return parts


def _square_sum(part: torch.Tensor) -> torch.Tensor:
    wide = part.double()
    return torch.dot(wide, wide)


class NormReader:
    """Measures this rank's squared sums (:meth:`measure`) and reduces them to every unit's
    norm (:meth:`reduce`), for the units of one run."""

    def __init__(self, units: Sequence[str], granularity: str):
        self.units = tuple(units)
        """Unit ids, in the order of the norm vector."""
        self.granularity = granularity
        """``block`` or ``site`` (:mod:`.units`)."""
        self.parts: list[tuple[str, torch.Tensor]] | None = None
        """:func:`owned_parts`, found at the first :meth:`measure` (views into the DDP
        gradient buffers, which live as long as the model)."""
        self.slots: tuple[list[str], torch.Tensor] | None = None
        """The site ids of the last :meth:`reduce` and their :func:`.units.unit_slots`, on
        the device."""

    def measure(self, model: list) -> tuple[list[str], torch.Tensor]:
        """Site ids and the float64 sums of squares of their owned parts (on the device, no
        host sync): call before the optimizer step (module docstring)."""
        if self.parts is None:
            self.parts = owned_parts(model)
        sums = [_square_sum(part) for _, part in self.parts]
        return ([sid for sid, _ in self.parts],
                torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device()))

    def reduce(self, measured: tuple[list[str], torch.Tensor]) -> np.ndarray:
        """Every unit's norm, identical on every rank: one float64 all-reduce (sum) of the
        ``U``-long vector of this rank's squares over the world, made on the device (one
        read, of the result). Collective."""
        sids, sums = measured
        if self.slots is None or self.slots[0] != sids:
            self.slots = (sids, unit_slots(sids, self.units, self.granularity).to(sums.device))
        vector = local_sq_vector(sums, self.slots[1])
        dist.all_reduce(vector)
        return norms_from_sq(vector.cpu().numpy())
