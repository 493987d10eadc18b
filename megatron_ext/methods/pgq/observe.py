"""PGQ stage i on every rank: observed passes on real batches, an SQNR observer at every GEMM.

``--pgq-profile-steps N`` replays the ``N`` batches training is about to consume
(``run.replay``, megatron's real schedule, no update, gradients zeroed after) through the
platform's observed pass (:func:`megatron_ext.precision.observe.observed_pass`), with

* every **linear site**: a :class:`GemmObserver` in place of its GEMM, which runs the GEMM
  unquantized (an ordinary matmul, so autograd gives the exact ``dx`` and ``dw``) and adds up,
  per operand and candidate format, ``‖t‖²`` and ``‖Q(t) − t‖²`` (:mod:`.sqnr`): ``x`` and
  ``w`` in forward, ``dy`` from a hook on the GEMM's output in backward;
* the **logits GEMM**: the same observer, installed as the output layer's ``_forward_impl``
  for the profile (an instance attribute shadowing megatron's method, deleted after), so it
  sees exactly what megatron's GEMM would (TP input mapping included);
* the **embedding**: a forward hook on megatron's ``VocabParallelEmbedding`` (the table) and a
  hook on its output's gradient (``dy``).

Outside the profile nothing is attached: the other steps run with zero overhead. Weights do
not change during the profile and are measured once.

**Ranks.** Each rank quantizes the shard it holds, as a tensor-parallel GEMM does, and one
all-reduce of a float64 vector (GEMMs x operands x (1 + candidates)) adds the sums over TP, PP
and DP. An operand replicated over TP (a column layer's ``x``, a row layer's ``dy``) is
counted once per TP rank, every piece of it equally often, and weights once per DP rank: the
factor cancels in the ratio. So the SQNR of a sharded operand is the unsharded one's whenever
no quantization block straddles a shard boundary (tile / block / MX formats with shards whole
multiples of the block); a per-row or per-tensor scale along a split axis is per shard, as
the sharded GEMM would use it.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_ext.methods.pgq.profile import EMBEDDING, LOGITS, GemmProfile, Profile, gemm_list
from megatron_ext.methods.pgq.sqnr import TRANSPOSED, noise_sums, oriented, sqnr
from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.layers import quantized_linears, tp_group, tp_input
from megatron_ext.precision.observe import observed_pass
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.training.distributed import device


class GemmObserver:
    """The sums of one layer's GEMM operands over a profile (module docstring)."""

    def __init__(self, candidates: dict[str, SiteFormats], group=None):
        self.candidates = candidates
        """Candidate name -> role formats."""
        self.group = group
        """The TP group the observed operands may be shards over (None without TP)."""
        self.sums: dict[tuple[str, str], torch.Tensor] = {}
        """(gemm, role) -> [‖t‖², ‖Q_c(t) − t‖² for each candidate c], float64 on the
        operands' device: summed there, read once by :func:`reduce_sqnr` (no host sync per
        operand, which on a GPU would serialise the profile's many small kernels)."""
        self.weight_seen = False

    def add(self, gemm: str, role: str, t: torch.Tensor, transposed: bool) -> None:
        formats = {c: f.operand(gemm, role) for c, f in self.candidates.items()}
        sums = noise_sums(oriented(t, transposed), formats, self.group)
        acc = self.sums.get((gemm, role))
        self.sums[(gemm, role)] = sums if acc is None else acc + sums

    def __call__(self, module, input, weight, kwargs) -> torch.Tensor:
        """Instead of a linear's GEMM: the unquantized GEMM, measuring its operands."""
        x = tp_input(input, kwargs)
        if not self.weight_seen:
            self.weight_seen = True
            for gemm in ("fprop", "dgrad"):
                self.add(gemm, "w", weight, (gemm, "w") in TRANSPOSED)
        for gemm in ("fprop", "wgrad"):
            self.add(gemm, "x", x, (gemm, "x") in TRANSPOSED)
        output = torch.matmul(x, weight.t())
        if output.requires_grad:
            output.register_hook(self._output_grad)
        return output if kwargs["bias"] is None else output + kwargs["bias"]

    def _output_grad(self, dy: torch.Tensor) -> None:
        for gemm in ("dgrad", "wgrad"):
            self.add(gemm, "dy", dy, (gemm, "dy") in TRANSPOSED)

    def embedding_hook(self, module, inputs, output) -> None:
        """Forward hook of the embedding: the table along V, its output gradient along T."""
        if not self.weight_seen:
            self.weight_seen = True
            self.add("fprop", "w", module.weight, True)
        if output.requires_grad:
            output.register_hook(lambda dy: self.add("wgrad", "dy", dy, True))


def _observed_impl(observer: GemmObserver, layer, input, weight, **kwargs):
    return observer(layer, input, weight, kwargs)


@contextmanager
def head_observed(model, logits: GemmObserver, embedding: GemmObserver):
    """``logits`` in place of the output layer's GEMM and ``embedding`` hooked on the word
    embedding of every local model chunk that has them, for the block; undone after."""
    patched, handles = [], []
    gpts = [m for chunk in model for m in chunk.modules() if isinstance(m, GPTModel)]
    try:
        for gpt in gpts:
            if gpt.post_process:
                gpt.output_layer._forward_impl = partial(_observed_impl, logits, gpt.output_layer)
                patched.append(gpt.output_layer)
            if gpt.pre_process:
                handles.append(gpt.embedding.word_embeddings.register_forward_hook(
                    embedding.embedding_hook))
        yield
    finally:
        for layer in patched:
            del layer._forward_impl
        for handle in handles:
            handle.remove()


def _slots(gemms: list[GemmProfile]):
    """(index, gemm, role) of every operand of ``gemms``, two slots per GEMM."""
    for i, g in enumerate(gemms):
        for j, role in enumerate(g.operands):
            yield 2 * i + j, g, role


def reduce_sqnr(observers: dict[str, GemmObserver], gemms: list[GemmProfile],
                candidates: list[str]) -> list[GemmProfile]:
    """Sum every rank's sums (one all-reduce) and fill in each operand's SQNR."""
    width = 1 + len(candidates)
    flat = torch.zeros(2 * len(gemms), width, dtype=torch.float64, device=device())
    for slot, g, role in _slots(gemms):
        obs = observers.get(g.site)
        if obs is not None and (g.gemm, role) in obs.sums:
            flat[slot] = obs.sums[(g.gemm, role)]
    dist.all_reduce(flat)
    flat = flat.cpu().tolist()
    filled = {g.name: dict(g.operands) for g in gemms}
    for slot, g, role in _slots(gemms):
        signal, *noise = flat[slot]
        if signal == 0:
            raise RuntimeError(f"PGQ profile: no rank measured {role} of {g.name}")
        ratios = {c: sqnr(signal, n) for c, n in zip(candidates, noise)}
        filled[g.name][role] = dataclasses.replace(g.operands[role], sqnr=ratios)
    return [dataclasses.replace(g, operands=filled[g.name]) for g in gemms]


def run_metadata(args) -> dict:
    """The profile's ``model`` record: the cost model's shape of a step plus the layout."""
    return {**dataclasses.asdict(ModelShape.from_args(args)),
            "micro_tokens": args.micro_batch_size * args.seq_length,
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "sequence_parallel": bool(args.sequence_parallel)}


def collect_profile(args, run, state, steps: int, candidates: dict[str, SiteFormats],
                    batch_seconds: list | None = None) -> Profile:
    """Profile the ``steps`` global batches training consumes next (``state``: the loop's
    TrainState) on every rank; every rank returns the same :class:`Profile`. Each batch's
    wall time is appended to ``batch_seconds`` when given (the first one includes the
    kernels' first-use compilation on a GPU)."""
    group = tp_group()
    sites = {sid: GemmObserver(candidates, group) for sid in quantized_linears(run.model)}
    head = {LOGITS: GemmObserver(candidates, group), EMBEDDING: GemmObserver(candidates, group)}
    losses = []
    with head_observed(run.model, head[LOGITS], head[EMBEDDING]):
        for k in range(steps):
            consumed = state.consumed_samples + k * args.global_batch_size
            start = time.perf_counter()
            losses.append(observed_pass(run, sites, consumed, seed=args.seed + consumed))
            if batch_seconds is not None:  # the loss is a float: the device has finished
                batch_seconds.append(time.perf_counter() - start)
    meta = run_metadata(args)
    gemms = gemm_list(ModelShape.from_args(args), meta["micro_tokens"], meta["tp"],
                      meta["sequence_parallel"])
    gemms = reduce_sqnr({**sites, **head}, gemms, list(candidates))
    return Profile(state.iteration, steps, tuple(losses), meta,
                   {c: f.to_dict() for c, f in candidates.items()}, tuple(gemms))
