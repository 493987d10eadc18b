"""SNIP steps 1-3: per-site statistics from high-precision forward/backward passes.

A :class:`SiteObserver` is attached to a quantized linear (``module.observer``) only during
a refresh; a normal step never sees it (``observer is None``: zero overhead). While attached,
the site runs its GEMMs **unquantized** and records, per micro-batch, what SNIP §4 needs.
Notation for one site: ``x`` (M x K tokens x inputs), ``w`` (N x K), ``dy`` (M x N),
``dx``, ``dw``; ``δ_f(t) = q_f(t) - t`` the quantization error of candidate format ``f``
applied as the GEMM that reads ``t`` applies it (blocks along its reduction axis, see
:mod:`megatron_ext.precision.gemm`); ``‖·‖_r`` the norm of row ``r``.

Every statistic is a **sum of squares**, kept per site as a float64 scalar on the device
(per candidate format where it involves an error; read to the host once per refresh), so
ranks add their parts with one all-reduce of ``sites x stats`` scalars (the error GEMMs
below are completed over TP / DP first).
Row-wise products (SNIP §6.3 "row-wise formulation") are taken per row (token ``m`` of x /
dy / dx, output channel ``n`` of w / dw), which needs each row's norm complete: under
tensor parallelism a row split across TP ranks (row-parallel ``x``, ``dx``, ``w``) is
completed with an all-reduce of one M- or N-vector inside the TP group. A quantity held
identically by several ranks (replicated over TP or DP) is scaled by 1/replicas before
the global sum, so the sum counts it once. ``dy`` and ``dx`` arrive scaled by the schedule
(loss / micro-batches) and are divided by DP so that they are gradients of the global-batch
loss; ``dw`` is accumulated over micro-batches and averaged over DP (one all-reduce of the
site's gradient per refresh pass, like DDP's).

=============  =================================================  ============================
statistic      value                                              used for
=============  =================================================  ============================
``xx ww``      ‖x‖², ‖w‖², ‖dy‖², ‖dx‖², ‖dw‖²                    report, ΔL/ΔW normalisation
``dydy ...``
``Lx[f]``      Σ_m ‖dx_m‖² ‖δ_f(x)_m‖²       (fprop, along K)     ΔL from x  (§4.2)
``Lw[f]``      Σ_n ‖dw_n‖² ‖δ_f(w)_n‖²       (fprop)              ΔL from w  (§4.2)
``ex[f] ew[f]``  ‖δ_f(x)‖², ‖δ_f(w)‖²          (fprop)              forward error ‖δy‖, baselines
``Bdy[f]``     ‖δ_f(dy)‖²                     (dgrad, along N)     dgrad error ‖δdx‖, baselines
``Bw[f]``      ‖dy · δ_f(w)‖²                 (dgrad, along N)     dgrad error ‖δdx‖
``Bdyw[f]``    ‖δ_f(dy) · w‖²                 (dgrad, along N)     dgrad error ‖δdx‖
``Gdy[f]``     Σ_m ‖δ_f(dy)_m‖² ‖x_m‖²       (wgrad, along T)     paper's isotropic own error
``Gx[f]``      Σ_m ‖dy_m‖² ‖δ_f(x)_m‖²       (wgrad, along T)     (report, groundtruth.py)
``dxdxN``      Σ_m ‖dx_m‖² κ_m²  (qkv, fc1: after a norm)         dgrad error into the residual
``dgB dgF``    ‖Δg‖²: step-2 response, ‖g_probe - g_base‖² (3)    ‖∇g‖ by Theorem 4.2
``dxB dxBN``   ‖Δdx‖², Σ_m ‖Δdx_m‖² κ_m²: step-2 response at the   in-layer transfer fc2→fc1,
               site's input                                       proj→qkv
``resB``       ‖step-2 response of the residual gradient‖²        gain from the top to the site's
               at the norm in front (qkv, fc1)                    residual entry point
``AA``         ‖A‖² (AdamW derivative, :mod:`.adam`)              report
``WGdy[f]``    ‖A ⊙ (δ_f(dy)^T x)‖²          (wgrad, along T)     own AdamW-weighted error
``WGx[f]``     ‖A ⊙ (dy^T δ_f(x))‖²          (wgrad, along T)     own AdamW-weighted error
``dgAB dgAF``  ‖A ⊙ (g_probe - g_base)‖²                          AdamW-weighted probe gains
=============  =================================================  ============================

``WG*``, ``Bdyw`` and ``Bw`` are the **exact norms of the error GEMMs** the quantized site
would run: the own wgrad error ``δg = δdy^T x + dy^T δx`` (N x K, one signed tensor per
candidate and operand, summed over the pass's micro-batches and DP-averaged like ``dw``) and
the dgrad error ``δdx = δdy·w + dy·δw`` (M x K per micro-batch; under TP a column-parallel
site's product is a partial sum over its N columns and is all-reduced, as ``dx`` is, before
squaring). Only the cross terms between the two operands' errors (and ``δdy^T δx``) are
dropped, since an option picks the two formats independently. Why exact and not the
random-sign expectation ``Σ_m δdy_mn² x_mk²`` (the rows' errors adding as independent): the
round-to-nearest errors of a per-tensor format are correlated across tokens (a small value
flushed to zero in one token is flushed in its neighbours too), so the rows' errors add
coherently, up to M times the independent sum when the rows are alike; the independent form
put a site's own wgrad error 0.33-0.87x of its measurement for ``fp4-tensor``. ``WG*`` (and
``dgA*``) need AdamW's state after the step (:meth:`SiteObserver.adam_weighted`): given
before the passes (training: :mod:`.refresh` runs them after the step, on the weights before
it), each N x K tensor is weighted and freed when its site's pass is complete, in the site's
backward; given after, every one of them is kept until then.

``κ_m²`` is the gain of the norm in front of ``qkv`` / ``fc1`` for an isotropic error in the
site's ``dx`` row ``m``: the norm's backward ``J^T δ = (γ ⊙ δ - x̂ (x̂ · γ ⊙ δ)/H) / r_m``
(``r_m`` the row's RMS, or its standard deviation for LayerNorm) has
``E‖J^T δ‖² = ‖δ‖² κ_m²`` with ``κ_m² = mean(γ²) / (r_m² + eps)``, dropping the O(1/H)
projection term. :meth:`SiteObserver.norm_forward` takes it from a forward hook on the norm.

Steps 2 and 3 (:data:`PROBE_BACKWARD`, :data:`PROBE_FORWARD`) use Gaussian noise in the last
layer. In backward, the gradient of the last layer's output (the **residual stream** at the
top) is *replaced* by noise ``ξ`` (:meth:`SiteObserver.residual_probe`, a hook on that
output): the backward pass is linear in its incoming gradient, so every gradient below is
then exactly the response ``J^T ξ`` (no difference of two nearly equal passes), through both
the skip connections and the branches. In forward, noise is added to the input ``x`` of the
**noise site** (the last layer's ``fc2``), whose observer draws both. The noise is drawn per
sample from a generator seeded by the sample's global index, so every TP / DP layout draws
the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear

from megatron_ext.formats import get_format
from megatron_ext.precision.gemm import quantize
from megatron_ext.precision.layers import tp_group, tp_input
from megatron_ext.precision.site_formats import PASSTHROUGH
from megatron_ext.methods.snip.observed_gemm import ObservedGemm, TapInput
from megatron_ext.methods.snip.probe_noise import (BASE, PROBE_BACKWARD, PROBE_FORWARD,
                                                   ProbeNoise)
from megatron_ext.methods.snip.tensor_store import Stored, TensorStore, on_device
from megatron_ext.training.memory import trim_heap

SCALARS = ("xx", "ww", "dydy", "dxdx", "dxdxN", "dwdw", "AA", "dgB", "dgF", "dgAB",
           "dgAF", "dxB", "dxBN", "resB", "noiseB", "noiseF")
"""Per-site scalar statistics (``noiseB``: ‖ξ‖² of the residual-stream noise, ``noiseF``:
‖ν‖² of the forward noise; noise site only)."""
PER_FORMAT = {"Lx": "x", "ex": "x", "Gx": "x", "WGx": "x", "Lw": "w", "ew": "w", "Bw": "w",
              "Bdy": "dy", "Bdyw": "dy", "Gdy": "dy", "WGdy": "dy"}

"""Per-candidate statistics and the role whose candidate formats index them."""


def _rows_sq(t: torch.Tensor) -> torch.Tensor:
    """Squared norm of each row of ``t`` viewed as (rows, last dim), in float64."""
    return t.detach().double().reshape(-1, t.shape[-1]).square().sum(-1)


def _error(t: torch.Tensor, name: str, axis: int, group) -> torch.Tensor:
    """``q(t) - t`` for format ``name`` along ``axis`` (the GEMM's reduction axis), a
    tensor-wide scale from the whole tensor over the TP ``group`` as the GEMM takes it."""
    if name == PASSTHROUGH:
        return torch.zeros_like(t)
    return quantize(t, get_format(name), axis=axis, group=group) - t


def _norm_gain(norm: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """κ_m² = mean(γ²) / (r_m² + eps) per row of the norm's input ``h``."""
    eps = norm.eps if norm.eps is not None else torch.finfo(h.dtype).eps  # torch's default
    h = h.detach().double()
    if isinstance(norm, torch.nn.LayerNorm):
        h = h - h.mean(-1, keepdim=True)
    gamma2 = (norm.weight.detach().double().square().mean() if norm.weight is not None
              else 1.0)
    return gamma2 / (h.square().mean(-1).reshape(-1) + eps)


class SiteObserver(ProbeNoise):
    """Statistics of one site over a refresh (see the module docstring; the probes' noise
    comes from :class:`~.probe_noise.ProbeNoise`)."""

    def __init__(self, site: str, module, candidates: dict[str, tuple[str, ...]],
                 noise_scale: float = 0.0, store: TensorStore | None = None):
        self.site = site
        self.column = isinstance(module, ColumnParallelLinear)
        self.sequence_parallel = bool(getattr(module, "sequence_parallel", False))
        self.candidates = candidates
        self.noise_scale = noise_scale
        """Relative noise std at the noise site (0: this is not the noise site)."""
        self.probe_map: torch.Tensor | None = None
        """``--snip-probe dgrad``: the last layer's entry map (:func:`.probe_noise.entry_map`)
        that shapes the backward probe's noise; None: isotropic noise."""
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.group = tp_group()
        """The TP group (None without TP): tensor-wide scales are taken over it."""
        self.dp = parallel_state.get_data_parallel_world_size()
        self.mode = BASE
        self.active = True
        """Whether this site is observed in the current passes; an inactive one (another
        group's turn, ``--snip-sites-per-pass``) runs the same unquantized GEMM and noise
        and records nothing."""
        self.sample_offsets: list[int] = []
        """Global index of the first sample of each micro-batch of the pass, in order."""
        self.micro_batch_size = 1
        self.stats = {k: 0.0 for k in SCALARS}
        for key, role in PER_FORMAT.items():
            self.stats[key] = {f: 0.0 for f in candidates[role]}
        self._dw = None
        self._g_base = None
        """The base pass's DP-averaged dw for step 3's ``dgF`` (freed there): FP32 with one
        micro-batch and DP = 1 (exact), else float64; a :class:`Stored` of :attr:`store`."""
        self.store = store or TensorStore()
        """Where ``_g_base`` waits for step 3 (default: the weight's device;
        ``--snip-offload``); ``A²`` comes stored the same way and is brought to the
        weight's device for each use."""
        self._probe_dg: dict[str, torch.Tensor] = {}
        self._wgrad_error = {"WGdy": {f: 0.0 for f in candidates["dy"]},
                             "WGx": {f: 0.0 for f in candidates["x"]}}
        """Signed wgrad errors ``δ_f(dy)^T x`` and ``dy^T δ_f(x)`` (N x K, this rank's shard of
        the weight) summed over the base pass, DP-averaged when the site's pass is complete."""
        self._a2: Stored | None = None
        """``A²`` of this site's weight once given (:meth:`adam_weighted`): from then on each
        A-weighted error is weighted and freed as soon as it is complete."""
        self._fwd_micro = self._bwd_micro = self._gemm_micro = 0
        self._norm_gain = None
        """κ_m² rows of the norm that just ran in front of this site (steps 1 and 2)."""

    # -- replication -------------------------------------------------------------------
    @property
    def x_rows_replicated(self) -> bool:
        """Whether the module-input rows seen here are held by every TP rank."""
        return not (self.column and self.sequence_parallel)

    def _tp_complete(self, rows: torch.Tensor, partial: bool) -> torch.Tensor:
        """Complete rows split over TP columns (sum of the ranks' parts)."""
        if partial and self.tp > 1:
            dist.all_reduce(rows, group=parallel_state.get_tensor_model_parallel_group())
        return rows

    def _add(self, key: str, value: torch.Tensor, fmt: str | None = None, rep: float = 1.0):
        amount = on_device(value.sum()) * rep
        if fmt is None:
            self.stats[key] += amount
        else:
            self.stats[key][fmt] += amount

    # -- the observed call ---------------------------------------------------------------
    def __call__(self, module, input, weight, kwargs):
        """Replaces the site's ``_forward_impl`` while attached: unquantized GEMM + hooks."""
        if self.active and self.mode in (BASE, PROBE_BACKWARD):
            input = TapInput.apply(input, self)
        x = tp_input(input, kwargs)
        if self.mode == PROBE_FORWARD and self.noise_scale:
            x = self.add_forward_noise(x)
        return ObservedGemm.apply(x, weight, kwargs["bias"], self,
                                  self.mode == BASE and self.active)

    def begin_pass(self, mode: str, sample_offsets: list[int], micro_batch_size: int):
        self.mode, self.sample_offsets = mode, sample_offsets
        self.micro_batch_size = micro_batch_size
        self._fwd_micro = self._bwd_micro = self._gemm_micro = 0
        self._dw = None

    # module input: x rows and dx rows (ΔL from x)
    def input_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.mode != BASE:
            return None
        partial = not self.column
        errors = [_rows_sq(_error(x, f, -1, self.group)) for f in self.candidates["x"]]
        rows = [_rows_sq(x), *errors]
        rows = self._tp_complete(torch.stack(rows), partial)
        rep = 1.0 / self.tp if self.x_rows_replicated else 1.0
        self._add("xx", rows[0], rep=rep)
        for f, r in zip(self.candidates["x"], rows[1:]):
            self._add("ex", r, f, rep)
        return rows

    def norm_forward(self, norm: torch.nn.Module, h: torch.Tensor) -> None:
        """Forward hook of the norm in front of this site, on its input (the residual stream):
        κ_m² for the next tap; step 2 also: watch the residual gradient's response."""
        if not self.active:
            return
        if self.mode in (BASE, PROBE_BACKWARD):
            self._norm_gain = _norm_gain(norm, h)
        if self.mode == PROBE_BACKWARD and h.requires_grad:
            h.register_hook(self._residual_response)

    def _residual_response(self, grad: torch.Tensor) -> None:
        rep = 1.0 / self.tp if self.x_rows_replicated else 1.0
        self.stats["resB"] += on_device(grad.detach().double().square().sum()) * rep / self.dp ** 2

    def take_norm_gain(self) -> torch.Tensor | None:
        gain, self._norm_gain = self._norm_gain, None
        return gain

    def input_backward(self, rows: torch.Tensor, dx: torch.Tensor,
                       norm_gain: torch.Tensor | None) -> None:
        dx_rows = self._tp_complete(_rows_sq(dx), not self.column) / self.dp ** 2
        rep = 1.0 / self.tp if self.x_rows_replicated else 1.0
        probe = self.mode == PROBE_BACKWARD  # dx is then the response to the probe alone
        self._add("dxB" if probe else "dxdx", dx_rows, rep=rep)
        if norm_gain is not None:
            self._add("dxBN" if probe else "dxdxN", dx_rows * norm_gain, rep=rep)
        if probe:
            return
        for f, r in zip(self.candidates["x"], rows[1:]):
            self._add("Lx", dx_rows * r, f, rep)

    # GEMM backward: dy-side statistics
    def gemm_backward(self, x2: torch.Tensor, dy2: torch.Tensor, w: torch.Tensor) -> None:
        """One micro-batch's wgrad and dgrad statistics (``dy2`` as the schedule scales it).
        Bounded memory: one M x N float64 tensor at a time (``dy``, then each error of it),
        each error GEMM product squared as soon as it is made."""
        x, w = x2.detach().double(), w.detach().double()
        dy = dy2.detach().double().div_(self.dp)
        weigh_now = self._a2 is not None and len(self.sample_offsets) == 1 and self.dp == 1
        a2 = self._a2.get(x2.device) if weigh_now else None  # read once (host / disk offload)
        x_rows, dy_rows = _rows_sq(x), _rows_sq(dy)
        rep_dy = 1.0 if self.column else 1.0 / self.tp
        self._add("dydy", dy_rows, rep=rep_dy)
        for f in self.candidates["x"]:
            err = _error(x2.t(), f, -1, self.group).t().double()
            self._add("Gx", _rows_sq(err) * dy_rows, f)
            self._wgrad("WGx", f, dy.t() @ err, a2)
            err = None
        for f in self.candidates["w"]:  # dy·δ_f(w): this micro-batch's dgrad error (M x K)
            self._dgrad_error("Bw", f, dy @ _error(w.t(), f, -1, self.group).t().double())
        dy = None
        for f in self.candidates["dy"]:  # δ_f(dy)·w
            err = _error(dy2, f, -1, self.group).double().div_(self.dp)
            self._add("Bdy", _rows_sq(err), f, rep_dy)
            self._dgrad_error("Bdyw", f, err @ w)
            err = None
            err = _error(dy2.t(), f, -1, self.group).t().double().div_(self.dp)
            self._add("Gdy", _rows_sq(err) * x_rows, f)
            self._wgrad("WGdy", f, err.t() @ x, a2)
            err = None
        trim_heap()

    def _wgrad(self, key: str, f: str, product: torch.Tensor, a2: torch.Tensor | None) -> None:
        """Add one micro-batch's wgrad error ``product`` (N x K). Given ``a2`` (``A²`` on the
        product's device: the error is the whole global batch's, one micro-batch and no DP),
        it is weighted at once and dropped (:meth:`_weigh`'s sum, the same float64
        operations); else summed until the site's pass is complete."""
        if a2 is not None:
            self.stats[key][f] += on_device((a2 * product.square()).sum())
        else:
            self._wgrad_error[key][f] = self._wgrad_error[key][f] + product

    def _dgrad_error(self, key: str, f: str, product: torch.Tensor) -> None:
        """``Bdyw``, ``Bw``: the squared norm of a dgrad error product, completed over TP
        where ``dx`` is a partial sum (column-parallel: the sum over this rank's N columns);
        the complete product is then held by every TP rank."""
        product = self._tp_complete(product, self.column)
        self._add(key, product.square(), f, 1.0 / self.tp if self.column else 1.0)

    def accumulate_dw(self, dw: torch.Tensor, weight: torch.Tensor) -> None:
        """Add one micro-batch's dw; after the pass's last micro-batch the site is complete
        (:meth:`end_pass`, here, in its backward: its pass-long tensors go at once)."""
        dw = dw.detach().double()
        self._dw = dw if self._dw is None else self._dw + dw
        self._gemm_micro += 1
        if self._gemm_micro == len(self.sample_offsets):
            self.end_pass(weight)

    # -- end of a pass -------------------------------------------------------------------
    def end_pass(self, weight: torch.Tensor) -> None:
        """DP-average this pass's dw; base: weight statistics, the wgrad errors; probes:
        ``Δg``. Runs once per pass, when the site's last micro-batch is through its backward
        (again after the pass: nothing left to do)."""
        if self._dw is None:
            return
        if self.dp > 1:
            dist.all_reduce(self._dw, group=parallel_state.get_data_parallel_group())
        dw = self._dw / self.dp
        self._dw = None
        if self.mode == BASE:
            self._weight_stats(weight.detach().double(), dw)
            single = len(self.sample_offsets) == 1 and self.dp == 1  # dw: one FP32 GEMM's
            self._g_base = self.store.put(dw.float() if single else dw)  # FP32 where exact
            for error in (e for errors in self._wgrad_error.values() for e in errors.values()):
                if self.dp > 1:  # the global-batch error: DP average (already divided by dp)
                    dist.all_reduce(error, group=parallel_state.get_data_parallel_group())
        else:
            key = "dgB" if self.mode == PROBE_BACKWARD else "dgF"
            if key == "dgF":
                dw = dw - self._g_base.get(dw.device).double()
                self._g_base.free()
                self._g_base = None
            self._probe_dg[key] = dw
            self.stats[key] += on_device(dw.square().sum()) / self.dp
        if self._a2 is not None:
            self._weigh()
        trim_heap()

    def adam_weighted(self, a2: torch.Tensor | Stored) -> None:
        """The AdamW-weighted statistics, given ``A²`` of this site's local weight after the
        step (float64, or float32 to hold less; a tensor or a :class:`Stored`); both it and
        the DP-reduced wgrad errors are replicated over DP (counted once). Given before the
        passes, each error is weighted as soon as its site's pass is complete and never kept;
        given after, the kept ones now."""
        self._a2 = a2 if isinstance(a2, Stored) else Stored(a2)
        total = self._a2.total  # made where A² was (not on the host: no wait for its copy)
        self.stats["AA"] += (on_device(self._a2.get().double().sum()) if total is None
                             else total) / self.dp
        self._weigh()

    def _weigh(self) -> None:
        """Add ‖A ⊙ e‖² of every complete error tensor and free it."""
        a2 = None
        for key, errors in self._wgrad_error.items():
            for f, error in errors.items():
                if torch.is_tensor(error):
                    a2 = self._a2.get(error.device) if a2 is None else a2
                    self.stats[key][f] += on_device((a2 * error.square()).sum()) / self.dp
                    errors[f] = 0.0
        for key, dg in self._probe_dg.items():
            a2 = self._a2.get(dg.device) if a2 is None else a2
            self.stats[key.replace("dg", "dgA")] += on_device((a2 * dg.square()).sum()) / self.dp
        self._probe_dg = {}

    def _weight_stats(self, w: torch.Tensor, dw: torch.Tensor) -> None:
        partial = not self.column
        rep = (1.0 if self.column else 1.0 / self.tp) / self.dp
        w_rows = self._tp_complete(_rows_sq(w), partial)
        dw_rows = self._tp_complete(_rows_sq(dw), partial)
        self._add("ww", w_rows, rep=rep)
        self._add("dwdw", dw_rows, rep=rep)
        for f in self.candidates["w"]:
            fprop = self._tp_complete(_rows_sq(_error(w, f, 1, self.group)), partial)
            self._add("ew", fprop, f, rep)
            self._add("Lw", dw_rows * fprop, f, rep)
