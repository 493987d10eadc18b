"""What a SNIP refresh holds beyond a normal step, per rank, and whether it fits.

A refresh (:mod:`.refresh`) runs its three observed passes after step ``s+1`` on the weights
before it, with AdamW's ``A²`` known, so per rank it holds, beyond what a step holds:

* ``snapshot``: a copy of every local parameter in the model's dtype, from before step
  ``s+1`` until the passes end;
* ``adam``: ``A²`` of every local site weight, FP32;
* ``base_grad``: the base pass's DP-averaged ``dw`` of every site until step 3: FP32 with
  one micro-batch per step and DP = 1 (where that is exact), else float64;
* ``accumulators``: float64 sums over a pass's micro-batches (``dw`` and one signed wgrad
  error per ``x`` and ``dy`` candidate): with one micro-batch per step only the site in
  its backward holds them; with several, every observed site holds them for the whole pass
  (all of the rank's, or one group of ``--snip-sites-per-pass``: the largest group's); with
  one micro-batch and no DP no error is summed: each is weighted as it is made (its site
  holds ``dw``, the product and the two temporaries of ``A² ⊙ e²``);
* ``transient``: the largest site's float64 work in its backward (three M x N tensors:
  ``dy`` or one error of it and its square; two M x K; the quantizer's two M x N FP32).

With ``--snip-offload host`` (the default on a GPU) the snapshot, ``A²`` and ``dw`` wait in
host memory (``host``) and the device holds one site's ``A²`` and ``dw`` at a time. With
``--snip-offload disk`` they wait in files instead (``disk``: nothing on the host either):
memory holds one site's ``A²`` and ``dw`` at a time and, while the snapshot is swapped in
and out, one parameter (not counted: a step's own work is larger).

The dry run shows the device total per pipeline stage as its ``extra`` memory; training
compares it with the memory free after start-up (:func:`check_fits`) before the first step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_ext.errors import UsageError
from megatron_ext.precision.cost import ModelShape
from megatron_ext.sites import COLUMN_SITES, SITES

GIB = 2 ** 30
WEIGH_TEMPORARIES = 3
"""N x K float64 tensors of weighting one wgrad error at once: ``e``, ``e²``, ``A² ⊙ e²``."""


@dataclass(frozen=True)
class RefreshMemory:
    """Bytes one rank holds for a refresh beyond a normal step (module docstring)."""

    snapshot: int
    """The local parameters before step ``s+1``, model dtype."""
    adam: int
    """``A²`` of the local site weights, FP32."""
    base_grad: int
    """The base pass's ``dw`` of the local sites (FP32 or float64)."""
    accumulators: int
    """Float64 sums over micro-batches: every site's (several micro-batches) or one site's."""
    transient: int
    """The largest site's float64 work in its backward."""
    host: int = 0
    """Snapshot, ``A²`` and ``dw`` in host memory (``--snip-offload host``; not in ``total``)."""
    disk: int = 0
    """Snapshot, ``A²`` and ``dw`` in files (``--snip-offload disk``; not in ``total``)."""

    @property
    def total(self) -> int:
        """Bytes on the model's device."""
        return sum(dataclasses.astuple(self)) - self.host - self.disk


def refresh_memory(params: int, param_bytes: int, sites: list[tuple[int, int]], tokens: int,
                   micro_batches: int, dp: int, sums_per_site: int, offload: str = "none",
                   sites_per_pass: int = 0) -> RefreshMemory:
    """The refresh's memory of a rank holding ``params`` parameters of ``param_bytes`` each and
    site weights of local shapes ``sites`` (N, K), ``tokens`` rows per micro-batch, with
    ``sums_per_site`` float64 N x K sums (1 + the x and dy candidates), DP size ``dp``;
    ``offload``: ``host`` or ``disk`` (snapshot, ``A²`` and ``dw`` moved there) or ``none``;
    ``sites_per_pass``: sites observed per set of passes (0: all)."""
    weights = sum(n * k for n, k in sites)
    step = sites_per_pass or max(len(sites), 1)
    group = max((sum(n * k for n, k in sites[g:g + step]) for g in range(0, len(sites), step)),
                default=0)  # the largest group's weights
    largest = max((n * k for n, k in sites), default=0)
    m_n = max((tokens * max(n, k) for n, k in sites), default=0)
    m_k = max((tokens * k for _, k in sites), default=0)
    held = group if micro_batches > 1 else largest
    single = micro_batches == 1 and dp == 1
    sums = 1 + WEIGH_TEMPORARIES if single else sums_per_site
    dw_bytes = 4 if single else 8
    kept = params * param_bytes + 4 * weights + dw_bytes * group
    moved = offload in ("host", "disk")
    on_device = largest if moved else weights  # offloaded: one site's A², dw at a time
    base_grad = largest if moved else group  # the group's dw, kept from step 1 to step 3
    return RefreshMemory(0 if moved else params * param_bytes, 4 * on_device,
                         dw_bytes * base_grad, 8 * sums * held,
                         8 * (3 * m_n + 2 * m_k) + 4 * 2 * m_n,
                         kept if offload == "host" else 0, kept if offload == "disk" else 0)


def local_sites(shape: ModelShape, layers, tp: int) -> list[tuple[int, int]]:
    """(N, K) of each site weight of ``layers`` one TP rank holds (qkv, fc1 split along N;
    proj, fc2 along K)."""
    out = []
    for _ in layers:
        for site in SITES:
            n, k = shape.site_nk(site)
            out.append((n // tp, k) if site in COLUMN_SITES else (n, k // tp))
    return out


def sums_per_site(candidates: dict) -> int:
    """Float64 N x K sums a site keeps over a pass: ``dw`` and the wgrad errors."""
    return 1 + len(candidates["x"]) + len(candidates["dy"])


def of_run(args, model, candidates: dict, offload: str = "none",
           sites_per_pass: int = 0) -> RefreshMemory:
    """This rank's refresh memory in a built run (``offload``: resolved ``--snip-offload``;
    ``sites_per_pass``: ``--snip-sites-per-pass``)."""
    from megatron_ext.precision.layers import quantized_linears
    params = [p for chunk in model for p in chunk.parameters()]
    sites = [tuple(m.weight.shape) for m in quantized_linears(model).values()]
    return refresh_memory(sum(p.numel() for p in params),
                          params[0].element_size() if params else 4, sites,
                          args.seq_length * args.micro_batch_size, args.num_microbatches,
                          args.data_parallel, sums_per_site(candidates), offload,
                          sites_per_pass)


def available_bytes() -> int | None:
    """Memory free now: the GPU's (CUDA), else the machine's ``MemAvailable``; None if
    unknown."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(need: RefreshMemory, activations: float) -> None:
    """``UsageError`` when a refresh plus a step's activations exceed the free memory."""
    free = available_bytes()
    if free is not None and need.total + activations > free:
        raise UsageError(
            f"a SNIP refresh needs {need.total / GIB:.2f} GiB per rank beyond a step "
            f"(snapshot {need.snapshot / GIB:.2f}, A² {need.adam / GIB:.2f}, dw "
            f"{need.base_grad / GIB:.2f}, float64 sums {need.accumulators / GIB:.2f}, "
            f"largest site {need.transient / GIB:.2f}); with a step's activations "
            f"(~{activations / GIB:.2f} GiB) that is more than the {free / GIB:.2f} GiB free: "
            f"observe fewer sites at a time (--snip-sites-per-pass), use fewer micro-batches "
            f"per step (larger --micro-batch-size) or more model parallelism")
