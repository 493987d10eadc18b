"""STQuant's optimizer checkpoint: every parameter's codes + scales, reloadable at another DP size.

**What is saved** (the optimizer's part of a checkpoint, under ``optimizer.stquant``):

* One megatron ``ShardedObject`` per *slice*: the elements ``[s, e)`` of one parameter's
  flattened (TP-local) tensor whose state one rank updates — the whole parameter, or with
  ``--use-distributed-optimizer`` one DP rank's range of it. Its key names the parameter, not
  the rank: ``optimizer.stquant.<layer name>`` (the name of :mod:`.allocator`, e.g.
  ``decoder.layers.mlp.linear_fc1.weight[3]``), plus ``.tp<r>`` for a tensor-parallel weight;
  the object's offset is the slice's place among that parameter's slices. It holds the
  range, the step, ``m`` and ``v`` as saved by :class:`~.quantizer.QState` (codes + scales; the
  float32 tensors of small parameters) and, for BF16 weights, the FP32 main copy. Every element
  is written once: by the ranks that *own* it (:class:`~.allocator.ParamEntry`: DP rank 0
  without the distributed optimizer, TP rank 0 for a TP-duplicated norm, never the tied
  output layer of the last stage).
* The common state: the format number :data:`FORMAT`, the layout it was saved at, the
  allocator's state (step, score engine, widths) and the *table* of every saved slice,
  ``{key: {"numel": N, "slices": [[s, e], ...]}}``, all-gathered at the save.
* The parameter-group settings, one object per (PP, TP) rank.

**Loading.** The checkpointer hands the optimizer the checkpoint's common state
(``metadata["saved_common"]``) before it builds its request, so each rank asks for exactly the
saved slices that overlap its own range, under any DP size (:func:`load_request`), and
rebuilds its state from them (:func:`assemble`). A slice that is exactly its own range is
taken as saved. Otherwise the moments are dequantized over its range and quantized again at
the saved width on its own block grid (``lead = s mod B``). Quantizing a dequantized state
gives its codes back whenever the blocks are the same (:mod:`.quantizer`), so where every
boundary of both layouts lies on the block grid — one DP rank, DP = 2 with ``B = 64`` — the
restored state is bit for bit the saved one. Where the new ranges cut a block (DP = 4: they
start at multiples of 32), each part gets its own scale: ``m``'s elements there move by at
most half the new scale (``amax_part / 2Q``, no more than the original quantization error),
``v``'s codes shift by a whole number of rungs (the new ladder ends at a rung of the old) and
come back within float32 rounding. ``docs/stquant.md`` gives the measured figures.

The TP and PP sizes must be those of the save (a TP shard's flat range means another thing
under another TP size): otherwise, and for a checkpoint of the earlier per-rank format or one
without STQuant state, loading stops with one line.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ext.errors import UsageError
from megatron_ext.methods.stquant.quantizer import QState, dequantize, quantize
from megatron_ext.training.distributed import gather_objects

FORMAT = 2
"""Version of the layout above (the per-rank format before it had none)."""

PREFIX = "optimizer.stquant"


def param_key(entry) -> str:
    """Checkpoint key of a parameter's state: its layer name, plus the TP rank for a
    tensor-parallel weight (each TP rank updates another part of it)."""
    split = getattr(entry.param.model, "tensor_model_parallel", False)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return f"{PREFIX}.{entry.name}" + (f".tp{rank}" if split else "")


def _range(entry) -> tuple[int, int]:
    return entry.param.start, entry.param.start + entry.param.main.numel()


def _layout() -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def _stored(value: QState | torch.Tensor):
    """A moment as saved: a QState's plain dict, or the float32 values, flat."""
    return value.to_dict() if isinstance(value, QState) else value.reshape(-1)


def _slice_state(entry, state: dict) -> dict:
    main, model = entry.param.main, entry.param.model
    return {"range": list(_range(entry)), "step": state["step"],
            "exp_avg": _stored(state["exp_avg"]), "exp_avg_sq": _stored(state["exp_avg_sq"]),
            "main": main.detach().reshape(-1).clone() if model.dtype != torch.float32 else None}


def _table(gathered: list[list]) -> dict:
    """``{key: {"numel", "slices"}}`` from every rank's ``(key, numel, s, e)``; the slices of
    a key sorted, each once (ranks own disjoint ranges)."""
    table: dict[str, dict] = {}
    for key, numel, start, end in (row for rank in gathered for row in rank):
        entry = table.setdefault(key, {"numel": numel, "slices": []})
        if [start, end] not in entry["slices"]:
            entry["slices"].append([start, end])
    for key, entry in table.items():
        entry["slices"].sort()
        if any(b > c for (_, b), (c, _) in zip(entry["slices"], entry["slices"][1:])):
            raise ValueError(f"STQuant: overlapping saved slices of {key}: {entry['slices']}")
    return table


def _groups(optimizer, data) -> ShardedObject:
    """The parameter-group settings of this (PP, TP) rank; DP ranks hold replicas."""
    layout = _layout()
    return ShardedObject(f"{PREFIX}.param_groups", data, (layout["pp"], layout["tp"]),
                         (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank())


def save_state(optimizer) -> dict:
    """The optimizer's part of a checkpoint (module docstring). Collective: the ranks
    all-gather their slices for the table."""
    owned = {}
    for e in optimizer.allocator.entries:
        state = e.param.sub.optimizer.state.get(e.param.main)
        if e.owner and state:
            owned[param_key(e)] = (e, state)
    table = _table(gather_objects([(key, e.param.model.numel(), *_range(e))
                                   for key, (e, _) in owned.items()]))
    slices = {}
    for key, (e, state) in owned.items():
        saved = table[key]["slices"]
        slices[key] = ShardedObject(key, _slice_state(e, state), (len(saved),),
                                    (saved.index(list(_range(e))),), replica_id=0)
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in sub.optimizer.param_groups]
              for sub in optimizer.subs]
    return {"format": FORMAT, "layout": _layout(), "allocator": optimizer.allocator.state_dict(),
            "table": table, "slices": slices, "param_groups": _groups(optimizer, groups)}


def saved_header(saved_common: dict | None) -> dict:
    """The STQuant part of a checkpoint's common state, checked: ``UsageError`` (one line) for
    a checkpoint without STQuant state, of the per-rank format, or of another TP / PP size."""
    saved = (saved_common or {}).get("stquant")
    if saved is None:
        raise UsageError("--load: the checkpoint holds no STQuant optimizer state (saved with "
                         "--optimizer adam?); --finetune loads its weights alone")
    if saved.get("format") != FORMAT:
        raise UsageError("--load: the checkpoint's STQuant optimizer state is in the earlier "
                         "per-rank format, which this version does not read; resume it with "
                         "the version that wrote it, or load its weights alone with --finetune")
    was, now = saved["layout"], _layout()
    if (was["tp"], was["pp"]) != (now["tp"], now["pp"]):
        raise UsageError(f"--load: the STQuant optimizer state was saved at TP {was['tp']} x PP "
                         f"{was['pp']}, this run is TP {now['tp']} x PP {now['pp']}; it "
                         "reshards over DP only (--finetune loads the weights)")
    return saved


def _overlapping(slices: list, start: int, end: int) -> list[int]:
    return [i for i, (a, b) in enumerate(slices) if a < end and start < b]


def load_request(optimizer, saved_common: dict | None) -> dict:
    """What this rank reads: the saved slices overlapping each of its parameters' ranges.
    dist_checkpointing wants each object asked for once as the main replica: by the rank
    that owns the slice's first element in this layout (every element has one owner)."""
    table = saved_header(saved_common)["table"]
    request: dict[str, dict] = {}
    for e in optimizer.allocator.entries:
        key = param_key(e)
        if key not in table:
            continue  # no state saved (it had no step yet)
        if table[key]["numel"] != e.param.model.numel():
            raise UsageError(f"--load: {key} has {table[key]['numel']} elements in the "
                             f"checkpoint's STQuant state, {e.param.model.numel()} here")
        slices, (start, end) = table[key]["slices"], _range(e)
        for i in _overlapping(slices, start, end):
            main = e.owner and start <= slices[i][0] < end
            request.setdefault(key, {})[str(i)] = ShardedObject(key, {}, (len(slices),), (i,),
                                                                replica_id=0 if main else 1)
    return {"slices": request, "param_groups": _groups(optimizer, [])}


def _values(stored) -> torch.Tensor:
    """The flat float32 values of a saved moment (codes dequantized)."""
    return dequantize(QState.from_dict(stored)) if isinstance(stored, dict) else stored.float()


def _cut(pieces: list[dict], name: str, start: int, end: int, read) -> torch.Tensor:
    parts = []
    for piece in pieces:
        a, b = piece["range"]
        parts.append(read(piece[name])[max(start, a) - a:min(end, b) - a])
    return torch.cat(parts)


def _moment(pieces: list[dict], name: str, start: int, end: int, block: int):
    values = _cut(pieces, name, start, end, _values)
    first = pieces[0][name]
    if not isinstance(first, dict):
        return values
    return quantize(values, first["mode"], first["bits"], block, start % block)


def assemble(pieces: list[dict], start: int, end: int, block: int) -> dict:
    """The state of elements ``[start, end)`` from the saved slices that overlap them (sorted,
    covering the range): ``step``, ``exp_avg``, ``exp_avg_sq`` (QStates on the grid of
    ``start`` with blocks of ``block``, or flat float32) and ``main`` (flat, or None)."""
    bounds = [p["range"] for p in pieces]
    if (not bounds or bounds[0][0] > start or bounds[-1][1] < end
            or any(b != c for (_, b), (c, _) in zip(bounds, bounds[1:]))):
        raise UsageError(f"--load: the saved STQuant slices {bounds} do not cover elements "
                         f"[{start}, {end}) of a parameter")
    same = bounds == [[start, end]] and all(
        not isinstance(pieces[0][n], dict) or pieces[0][n]["block"] == block
        for n in ("exp_avg", "exp_avg_sq"))
    if same:
        piece = pieces[0]
        moments = {n: QState.from_dict(piece[n]) if isinstance(piece[n], dict) else piece[n]
                   for n in ("exp_avg", "exp_avg_sq")}
        return {"step": piece["step"].clone(), **moments, "main": piece["main"]}
    main = None if pieces[0]["main"] is None else _cut(pieces, "main", start, end, lambda t: t)
    return {"step": pieces[0]["step"].clone(), "main": main,
            **{n: _moment(pieces, n, start, end, block) for n in ("exp_avg", "exp_avg_sq")}}


@torch.no_grad()
def restore(optimizer, saved: dict) -> None:
    """Put a loaded checkpoint's state (``saved``: this optimizer's part) back."""
    saved_header({"stquant": saved})
    optimizer.allocator.load_state_dict(saved["allocator"])
    for sub, groups in zip(optimizer.subs, saved["param_groups"]):
        for group, stored in zip(sub.optimizer.param_groups, groups):
            group.update(stored)
    for e in optimizer.allocator.entries:
        key = param_key(e)
        if key not in saved["table"]:
            continue
        start, end = _range(e)
        indices = _overlapping(saved["table"][key]["slices"], start, end)
        state = assemble([saved["slices"][key][str(i)] for i in indices], start, end,
                         optimizer.block)
        main = e.param.main
        e.param.sub.optimizer.state[main] = {
            "step": state["step"],
            **{n: state[n] if isinstance(state[n], QState) else state[n].view_as(main).clone()
               for n in ("exp_avg", "exp_avg_sq")}}
        if state["main"] is not None:
            main.copy_(state["main"].view_as(main))
