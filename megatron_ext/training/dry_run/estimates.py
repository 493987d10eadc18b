"""Back-of-the-envelope numbers for one GPU of a pipeline stage: memory, the step, the bubble.

Every number is an *estimate* from closed forms, meant to catch a layout that cannot fit or
a stage that is far slower than the others before 64 GPUs are queued; none is measured.

Memory of the model state, per GPU
----------------------------------
``P`` is the number of parameters one GPU holds (its TP shard of its pipeline stage), ``D``
the data-parallel size. With megatron-core's DDP and optimizer as this project configures
them (``megatron_ext/training/optimizer.py``: ``grad_reduce_in_fp32=True``, Adam)::

    weights     P · w           w = 2 bytes (BF16 params) or 4 (FP32 params, --no-bf16)
    gradients   P · 4           the DDP gradient buffer is FP32
    optimizer   P · (8 + c)/Z   Adam's m and v in FP32 (8 bytes) plus, for BF16 params, the
                                FP32 main copy (c = 4; c = 0 for FP32 params)

``Z = D`` with ``--use-distributed-optimizer`` (ZeRO-1: the optimizer state is sharded over
the DP group), else 1 — Megatron-LM's "18 bytes per parameter, 6 + 12/D with the distributed
optimizer". With FSDP all three lines are divided by ``D``. For ``--use-torch-fsdp2``
(``training/fsdp.py``) each rank keeps ``1/D`` of every weight, FSDP2 reduce-scatters the
gradients into ``1/D`` shards, and megatron's ordinary optimizer steps only those shards:
FP32 gradients of FP32 params, or, for BF16 params, FP32 main gradients (4 bytes) it copies
the BF16 shard gradients into; ``tests/distributed/test_fsdp_parallel.py`` checks the
three lines byte for byte against what each rank holds after a step (exact when ``D`` divides
every weight's first dimension; otherwise the first ranks hold one row more). Not counted:
the one FSDP unit (transformer layer or embedding) whose full weights are all-gathered while
it runs.
Megatron-FSDP (``--use-megatron-fsdp``, "optim_grads_params") shards the same three.
The optimizer line assumes FP32 states unless an extension's dry-run part gives the bytes of
its moments (``DryRunPart.moments``), which then replace the 8 bytes: ``--optimizer
stquant-adamw`` gives its codes + scales (``megatron_ext/methods/stquant/dry_run.py``).

Activations, per layer and micro-batch
--------------------------------------
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), §4 and Table 2, with 16-bit activations; ``s`` sequence length, ``b``
micro-batch, ``h`` hidden size, ``a`` attention heads, ``t`` TP size, in bytes::

    no TP           s·b·h · (34 + 5·a·s/h)
    TP              s·b·h · (10 + 24/t + 5·a·s/(h·t))
    TP + SP         s·b·h · (34 + 5·a·s/h) / t

``5·a·s/h`` is the attention core's ``s × s`` scores (softmax output, dropout mask, ...).
megatron-core's local ``DotProductAttention`` (``--attention-backend local``) and TE's unfused
attention store them; SDPA (``sdpa``, the default in local layers) and TE's flash / fused
attention do not, so the term is dropped for them (:func:`attention_of`).
The 34 is derived for a GPT-3 layer (4h GeLU MLP, multi-head attention, dropout masks); for
Llama (SwiGLU, GQA, no dropout) it is an approximation. The last stage also keeps the FP32
logits for the loss, ``4·s·b·v/t`` bytes (Korthikanti §4.3; ``v`` the padded vocabulary).

How many micro-batches a stage holds (megatron-core ``pipeline_parallel/schedules.py``):
stage ``k`` of ``p`` runs ``p − k − 1`` warm-up forwards before its first backward, so it
holds ``min(p − k, m)`` micro-batches of its layers (``m`` micro-batches per step); with
``v`` virtual stages (interleaved 1F1B) it runs ``2·(p − k − 1) + (v − 1)·p`` warm-up
forwards of one chunk (``L/(p·v)`` layers) each and holds ``min(that + 1, m·v)`` of them.

Time
----
Per-stage times ``t_k`` (forward + backward of one micro-batch on one GPU of stage ``k``)
come from the extension that estimates them — the precision platform, from its cost model
under the plan the run would start with (``megatron_ext/precision/dry_run.py``). The pipeline
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv:2104.04473, §2.2) then takes::

    1F1B          step = (m + p − 1) · max_k t_k         bubble = (p − 1) / (m + p − 1)
    interleaved   step = (v·m + p − 1) · max_k t_k / v   bubble = (p − 1) / (v·m + p − 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.training.attention_backend import resolve_attention_backend

GIB = 2.0**30
"""Bytes in a GiB."""


def attention_of(args, impl: str) -> str:
    """The core attention ``impl``'s layers run (``--attention-backend`` resolved; refused in
    one line where those layers cannot run it)."""
    return resolve_attention_backend(args.attention_backend, impl)


@dataclass(frozen=True)
class Layout:
    """The parallel layout and step shape the estimates need (from the parsed flags)."""

    tp: int
    """Tensor-parallel size ``t``."""
    pp: int
    """Pipeline stages ``p``."""
    dp: int
    """Data-parallel size ``D``."""
    vp: int
    """Virtual stages per pipeline stage ``v`` (1 without interleaving)."""
    micro_batches: int
    """Micro-batches per step per DP replica ``m``."""
    micro_batch: int
    """Sequences per micro-batch ``b``."""
    seq: int
    """Sequence length ``s``."""
    sequence_parallel: bool
    """``--sequence-parallel``."""
    bf16: bool
    """BF16 parameters (else FP32)."""
    distributed_optimizer: bool
    """``--use-distributed-optimizer``: optimizer state sharded over DP."""
    fsdp: bool
    """``--use-torch-fsdp2`` / ``--use-megatron-fsdp``: weights, grads, state sharded over DP."""
    flash_attention: bool
    """No ``s × s`` scores stored (SDPA, or Transformer Engine's flash / fused attention)."""

    @classmethod
    def from_args(cls, args, impl: str) -> "Layout":
        """The layout of the parsed flags; ``impl`` the layer implementation the job gets
        (``training.layer_impl.resolve_transformer_impl``)."""
        return cls(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                   args.data_parallel, args.virtual_pipeline_model_parallel_size or 1,
                   args.num_microbatches, args.micro_batch_size, args.seq_length,
                   bool(args.sequence_parallel), bool(args.bf16),
                   bool(args.use_distributed_optimizer),
                   bool(args.use_torch_fsdp2 or args.use_megatron_fsdp),
                   attention_of(args, impl) not in ("local", "unfused"))


@dataclass(frozen=True)
class Memory:
    """Estimated memory of one GPU, in bytes (module docstring for the formulas)."""

    weights: float
    """Parameters in their training dtype."""
    grads: float
    """The FP32 gradient buffer."""
    optimizer: float
    """Adam m, v and the FP32 main parameters (sharded by the distributed optimizer)."""
    activations: float
    """Activations kept for backward at the schedule's peak, plus the last stage's logits."""
    extra: float = 0.0
    """What extensions add (their dry-run parts' ``memory``)."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.extra


def model_state_bytes(params: int, layout: Layout,
                      moments: float | None = None) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes of a GPU holding ``params`` parameters; ``moments``:
    the bytes of the optimizer's m and v on it, in place of FP32 Adam's (already sharded)."""
    weights = params * (2 if layout.bf16 else 4)
    grads = params * 4.0
    optimizer = params * ((0 if moments is not None else 8) + (4 if layout.bf16 else 0))
    if layout.distributed_optimizer or layout.fsdp:
        optimizer /= layout.dp
    optimizer += moments or 0.0
    if layout.fsdp:
        weights, grads = weights / layout.dp, grads / layout.dp
    return float(weights), grads, float(optimizer)


def layer_activation_bytes(hidden: int, heads: int, layout: Layout) -> float:
    """Korthikanti et al. 2022, Table 2: bytes one layer keeps for one micro-batch on one GPU."""
    s, b, h, a, t = layout.seq, layout.micro_batch, hidden, heads, layout.tp
    scores = 0.0 if layout.flash_attention else 5.0 * a * s / h
    if t == 1 or layout.sequence_parallel:
        return s * b * h * (34.0 + scores) / t
    return s * b * h * (10.0 + 24.0 / t + scores / t)


def in_flight(stage: int, layout: Layout) -> int:
    """Chunk-micro-batches stage ``stage`` holds at the schedule's peak (module docstring)."""
    p, m, v = layout.pp, layout.micro_batches, layout.vp
    if v == 1:
        return min(p - stage, m)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)


def activation_bytes(stage: int, layers: int, hidden: int, heads: int, vocab: int,
                     layout: Layout) -> float:
    """Peak activation bytes of one GPU of ``stage`` holding ``layers`` layers."""
    per_chunk = layers // layout.vp
    total = in_flight(stage, layout) * per_chunk * layer_activation_bytes(hidden, heads, layout)
    if stage == layout.pp - 1:
        total += 4.0 * layout.seq * layout.micro_batch * vocab / layout.tp
    return total


def bubble_fraction(layout: Layout) -> float:
    """Idle share of a step: (p − 1) / (v·m + p − 1) (Narayanan et al. 2021, §2.2)."""
    p = layout.pp
    return (p - 1) / (layout.vp * layout.micro_batches + p - 1)


def step_time(stage_times: list[float], layout: Layout) -> float:
    """Seconds per step from per-micro-batch stage times: (v·m + p − 1) · max t_k / v."""
    v = layout.vp
    return (v * layout.micro_batches + layout.pp - 1) * max(stage_times) / v
