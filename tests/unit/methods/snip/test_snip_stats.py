"""SNIP statistics of one real megatron linear against a float64 brute-force recomputation,
and the Theorem-4.1 variance formulas the divergences rest on against Monte Carlo."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig

from megatron_ext.formats import fake_quant, get_format
from megatron_ext.precision.layers import quantized_class
from megatron_ext.methods.snip.probe_noise import dgrad_shaped, entry_map
from megatron_ext.methods.snip.stats import BASE, PROBE_BACKWARD, PROBE_FORWARD, SiteObserver
from megatron_ext.methods.snip.tensor_store import TensorStore

sys.path.insert(0, str(Path(__file__).parents[2] / "precision"))
from precision_helpers import megatron_world  # noqa: E402,F401  (fixture)

pytestmark = pytest.mark.usefixtures("megatron_world")

H, F, S, B = 128, 256, 16, 2


def _host(stats: dict) -> dict:
    """An observer's statistics (device scalars, or 0.0 where nothing was added) as floats."""
    return {k: _host(v) if isinstance(v, dict) else float(v) for k, v in stats.items()}

CANDIDATES = {"x": ("fp8_e4m3@tile128", "fp4_e2m1@tile128"),
              "w": ("fp8_e4m3@block128", "fp4_e2m1@block128"),
              "dy": ("fp8_e4m3@tile128", "fp4_e2m1@tile128")}


def _layer(base):
    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=F,
                               num_attention_heads=4, add_bias_linear=False,
                               use_cpu_initialization=True, gradient_accumulation_fusion=False)
    size_in, size_out = (H, F) if base is ColumnParallelLinear else (F, H)
    kw = {"gather_output": False} if base is ColumnParallelLinear else {"input_is_parallel": True}
    return quantized_class(base, 0, "fc1")(size_in, size_out, config=config,
                                           init_method=torch.nn.init.normal_, bias=False,
                                           skip_bias_add=True, **kw)


def _q(t, name, axis):
    return fake_quant(t, get_format(name), axis=axis)


def _rows(t):
    return t.double().reshape(-1, t.shape[-1]).square().sum(-1)


def _run(layer, obs, x, r, mode=BASE):
    obs.begin_pass(mode, [0], B)
    layer.observer = obs
    x = x.clone().requires_grad_(True)
    y, _ = layer(x)
    if mode == PROBE_BACKWARD:
        y.register_hook(obs.residual_probe)  # as refresh.py hooks the layer's output
    (y * r).sum().backward()
    obs.end_pass(layer.weight)
    layer.observer = None
    return x.grad


@pytest.mark.parametrize("base", [ColumnParallelLinear, RowParallelLinear])
def test_statistics_equal_brute_force(base):
    torch.manual_seed(0)
    layer = _layer(base)
    k = layer.weight.shape[1]
    x, r = torch.randn(S, B, k), torch.randn(S, B, layer.weight.shape[0])
    obs = SiteObserver("L0.fc1", layer, CANDIDATES)
    dx = _run(layer, obs, x, r)
    w, x2, dy = layer.weight.detach().double(), x.reshape(-1, k).double(), r.reshape(-1, r.shape[-1]).double()
    assert torch.allclose(dx.double().reshape(-1, k), dy @ w, rtol=1e-5, atol=1e-5)  # unquantized
    dw = dy.t() @ x2
    st = _host(obs.stats)
    expect = {"xx": x2.square().sum(), "ww": w.square().sum(), "dydy": dy.square().sum(),
              "dxdx": (dy @ w).square().sum(), "dwdw": dw.square().sum()}
    for key, value in expect.items():
        assert st[key] == pytest.approx(float(value), rel=1e-5), key
    for f in CANDIDATES["x"]:
        fprop, wgrad = _q(x2.float(), f, -1).double() - x2, _q(x2.t().float(), f, -1).t().double() - x2
        assert st["ex"][f] == pytest.approx(float(fprop.square().sum()), rel=1e-5)
        assert st["Lx"][f] == pytest.approx(float((_rows(dy @ w) * _rows(fprop)).sum()), rel=1e-5)
        assert st["Gx"][f] == pytest.approx(float((_rows(dy) * _rows(wgrad)).sum()), rel=1e-5)
    for f in CANDIDATES["w"]:
        err = _q(w.float(), f, 1).double() - w
        assert st["ew"][f] == pytest.approx(float(err.square().sum()), rel=1e-5)
        assert st["Lw"][f] == pytest.approx(float((_rows(dw) * _rows(err)).sum()), rel=1e-5)
        dgrad = _q(w.t().float(), f, -1).t().double() - w  # quantized along N
        assert st["Bw"][f] == pytest.approx(float((dy @ dgrad).square().sum()), rel=1e-5)
    for f in CANDIDATES["dy"]:
        dgrad = _q(dy.float(), f, -1).double() - dy
        wgrad = _q(dy.t().float(), f, -1).t().double() - dy
        assert st["Bdy"][f] == pytest.approx(float(dgrad.square().sum()), rel=1e-5)
        assert st["Bdyw"][f] == pytest.approx(float((dgrad @ w).square().sum()), rel=1e-5)
        assert st["Gdy"][f] == pytest.approx(float((_rows(wgrad) * _rows(x2)).sum()), rel=1e-5)
    # AdamW-weighted own errors: ‖A ⊙ δg‖² of the error GEMMs themselves
    a2 = torch.rand(w.shape, dtype=torch.float64)
    obs.adam_weighted(a2)
    st = _host(obs.stats)
    for f in CANDIDATES["dy"]:
        err = _q(dy.t().float(), f, -1).t().double() - dy  # quantized along the tokens
        expect = (a2 * (err.t() @ x2).square()).sum()
        assert st["WGdy"][f] == pytest.approx(float(expect), rel=1e-5)
    for f in CANDIDATES["x"]:
        err = _q(x2.t().float(), f, -1).t().double() - x2
        expect = (a2 * (dy.t() @ err).square()).sum()
        assert st["WGx"][f] == pytest.approx(float(expect), rel=1e-5)
    assert st["AA"] == pytest.approx(float(a2.sum()))


def test_probes_measure_the_gradient_change_of_the_noise():
    """Residual-stream noise ξ replacing the output gradient gives dw = ξ^T x exactly; forward
    noise ν on x changes dw by dy^T ν."""
    torch.manual_seed(1)
    layer = _layer(RowParallelLinear)
    x, r = torch.randn(S, B, F), torch.randn(S, B, H)
    obs = SiteObserver("L0.fc2", layer, CANDIDATES, noise_scale=0.1)
    _run(layer, obs, x, r)
    _run(layer, obs, x, r, PROBE_BACKWARD)
    xi = obs.noise_like(r, None, 0) * 0.1 * r.double().square().mean(-1, keepdim=True).sqrt()
    delta_b = xi.reshape(-1, H).t() @ x.reshape(-1, F).double()
    assert _host(obs.stats)["dgB"] == pytest.approx(float(delta_b.square().sum()), rel=1e-4)
    assert _host(obs.stats)["noiseB"] == pytest.approx(float(xi.square().sum()), rel=1e-5)
    # the response at the site's input: Δdx = ξ w (what the in-layer transfer divides by)
    sent_down = xi.reshape(-1, H) @ layer.weight.detach().double()
    assert _host(obs.stats)["dxB"] == pytest.approx(float(sent_down.square().sum()), rel=1e-5)
    _run(layer, obs, x, r, PROBE_FORWARD)
    obs.mode = PROBE_FORWARD  # noise_like seeds the forward stream
    nu = obs.noise_like(x, x.dim() - 1, 0) * 0.1 * float(x.square().mean().sqrt())
    delta_f = r.reshape(-1, H).double().t() @ nu.reshape(-1, F)
    assert _host(obs.stats)["dgF"] == pytest.approx(float(delta_f.square().sum()), rel=1e-4)
    a2 = torch.rand(H, F, dtype=torch.float64)
    obs.adam_weighted(a2)
    assert _host(obs.stats)["dgAB"] == pytest.approx(float((a2 * delta_b.square()).sum()), rel=1e-4)
    assert _host(obs.stats)["dgAF"] == pytest.approx(float((a2 * delta_f.square()).sum()), rel=1e-4)


def test_dgrad_probe_replaces_the_gradient_by_noise_through_the_entry_map():
    """--snip-probe dgrad: ξ = ε·M σ/rms(M) (ε seeded as the isotropic probe's, over M's rows);
    the probe's dw is ξ^T x exactly."""
    torch.manual_seed(2)
    layer = _layer(RowParallelLinear)
    x, r = torch.randn(S, B, F), torch.randn(S, B, H)
    obs = SiteObserver("L0.fc2", layer, CANDIDATES, noise_scale=0.1)
    mapping = torch.randn(3 * H, H, dtype=torch.float64)
    obs.probe_map = mapping
    _run(layer, obs, x, r)
    _run(layer, obs, x, r, PROBE_BACKWARD)
    eps = obs.noise_like(torch.zeros(S, B, 3 * H), None, 0)
    sigma = 0.1 * r.double().square().mean(-1, keepdim=True).sqrt()
    xi = eps @ mapping * sigma / (mapping.square().sum() / H).sqrt()
    assert _host(obs.stats)["noiseB"] == pytest.approx(float(xi.square().sum()), rel=1e-5)
    delta_b = xi.reshape(-1, H).t() @ x.reshape(-1, F).double()
    assert _host(obs.stats)["dgB"] == pytest.approx(float(delta_b.square().sum()), rel=1e-4)


def test_dgrad_shaped_noise_has_the_covariance_of_a_dgrad_error():
    """Monte Carlo: rows of ε·[W1⊙γ1; W2⊙γ2] have covariance Σ_i (W_i⊙γ_i)^T (W_i⊙γ_i),
    scaled to E‖ξ_m‖² = H σ_m² like the isotropic probe."""
    torch.manual_seed(3)
    h, n1, n2, rows = 8, 12, 20, 200_000
    w1, w2 = torch.randn(n1, h), torch.randn(n2, h) * 0.3
    g1, g2 = torch.rand(h) + 0.5, torch.rand(h) * 2
    mapping = entry_map([(w1, g1), (w2, g2)])
    eps = torch.randn(rows, n1 + n2, dtype=torch.float64)
    sigma = torch.full((rows, 1), 0.5, dtype=torch.float64)
    xi = dgrad_shaped(eps, mapping, sigma)
    m1, m2 = (w1 * g1).double(), (w2 * g2).double()
    cov = m1.t() @ m1 + m2.t() @ m2
    expect = cov * 0.25 * h / torch.trace(cov)
    assert torch.allclose(xi.t() @ xi / rows, expect, atol=0.02 * float(expect.abs().max()))
    assert float(xi.square().sum(-1).mean()) == pytest.approx(0.25 * h, rel=0.01)
    assert torch.equal(entry_map([(w1, None)]), w1.double())


def test_noise_is_per_sample_and_layout_free():
    """A sample's noise depends on its global index only: two micro-batches of one sample
    each draw what one micro-batch of two samples draws."""
    layer = _layer(RowParallelLinear)
    obs = SiteObserver("L0.fc2", layer, CANDIDATES, noise_scale=0.1)
    obs.begin_pass(PROBE_BACKWARD, [10, 11], 1)
    t = torch.zeros(S, 1, H)
    a, b = obs.noise_like(t, None, 0), obs.noise_like(t, None, 1)
    obs.begin_pass(PROBE_BACKWARD, [10], 2)
    both = obs.noise_like(torch.zeros(S, 2, H), None, 0)
    assert torch.equal(torch.cat([a, b], dim=1), both)


TENSOR = {"x": ("fp4_e2m1",), "w": ("fp4_e2m1",), "dy": ("fp4_e2m1",)}
"""E2M1 with one scale per tensor, round to nearest (the comparison regime's FP4)."""


def _coherent_run(x, r, w=None):
    layer = _layer(ColumnParallelLinear)
    if w is not None:
        layer.weight.data.copy_(w)
    obs = SiteObserver("L0.fc1", layer, TENSOR)
    _run(layer, obs, x, r)
    obs.adam_weighted(torch.ones_like(layer.weight, dtype=torch.float64))
    return _host(obs.stats), layer.weight.detach().double()


def test_wgrad_errors_of_identical_tokens_add_coherently():
    """Identical token rows round identically under a per-tensor format, so the M rows'
    wgrad errors add coherently: the exact ‖δdy^T x‖² (WGdy, A = 1) is M times the
    independent-row sum Σ_m ‖δdy_m‖² ‖x_m‖² (Gdy, what WGdy was), likewise WGx."""
    torch.manual_seed(4)
    x = torch.randn(1, 1, H).expand(S, B, H).contiguous()
    r = torch.randn(1, 1, F).expand(S, B, F).contiguous()
    st, _ = _coherent_run(x, r)
    f, m = "fp4_e2m1", S * B
    assert st["Gdy"][f] > 0 and st["Gx"][f] > 0
    assert st["WGdy"][f] == pytest.approx(m * st["Gdy"][f], rel=1e-6)
    assert st["WGx"][f] == pytest.approx(m * st["Gx"][f], rel=1e-6)


def test_dgrad_errors_along_the_reduction_axis_add_coherently():
    """A dy row constant along N rounds to one error per row, and identical rows of w make
    the dgrad GEMM add the N errors coherently: ‖δdy·w‖² (Bdyw) is N times the random-sign
    Σ_n ‖δdy_{:,n}‖² ‖w_n‖² (what Bdyw was), ‖dy·δw‖² (Bw) N times Σ_n ‖δw_n‖² ‖dy_{:,n}‖²."""
    torch.manual_seed(5)
    x = torch.randn(S, B, H)
    r = torch.randn(S, B, 1).expand(S, B, F).contiguous()
    st, w = _coherent_run(x, r, torch.randn(1, H).expand(F, H))
    dy, f = r.reshape(-1, F).double(), "fp4_e2m1"
    err_dy = _q(dy.float(), f, -1).double() - dy
    err_w = _q(w.t().float(), f, -1).t().double() - w
    independent_dy = float((err_dy.square().sum(0) * _rows(w)).sum())
    independent_w = float((_rows(err_w) * dy.square().sum(0)).sum())
    assert independent_dy > 0 and independent_w > 0
    assert st["Bdyw"][f] == pytest.approx(F * independent_dy, rel=1e-6)
    assert st["Bw"][f] == pytest.approx(F * independent_w, rel=1e-6)


def test_variance_formulas_match_monte_carlo():
    """The variances behind Lx and Gdy (row-wise Theorem 4.1: isotropic row errors of given
    row norms) against sampling them."""
    rng = np.random.default_rng(0)
    m, n, k = 24, 12, 16
    grad, x = rng.normal(size=(m, k)), rng.normal(size=(m, k))
    row_norm = rng.uniform(0.1, 2.0, size=m)

    def sample(cols):
        d = rng.normal(size=(m, cols))
        return d / np.linalg.norm(d, axis=1, keepdims=True) * row_norm[:, None]

    draws = 20000
    loss = np.mean([np.sum(grad * sample(k)) ** 2 for _ in range(draws)])
    assert loss == pytest.approx(np.sum((grad ** 2).sum(1) * row_norm ** 2) / k, rel=0.05)
    own = np.mean([np.sum((sample(n).T @ x) ** 2) for _ in range(draws // 4)])
    assert own == pytest.approx(np.sum(row_norm ** 2 * (x ** 2).sum(1)), rel=0.05)


@pytest.mark.parametrize("norm_cls", [torch.nn.RMSNorm, torch.nn.LayerNorm])
def test_norm_gain_matches_the_norms_backward_on_isotropic_errors(norm_cls):
    """κ_m² (the dgrad error's gain into the residual stream) against Monte Carlo through the
    norm's own autograd backward: E‖J^T δ‖² = ‖δ‖² κ_m², up to the dropped O(1/H) term."""
    torch.manual_seed(2)
    norm = norm_cls(H, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    h = (torch.randn(S, B, H, dtype=torch.float64) * torch.rand(S, B, 1) * 3).requires_grad_()
    obs = SiteObserver("L0.fc1", _layer(ColumnParallelLinear), CANDIDATES)
    obs.norm_forward(norm, h)
    gain = obs.take_norm_gain()
    out = norm(h)
    draws = [torch.autograd.grad(out, h, torch.randn_like(out), retain_graph=True)[0]
             for _ in range(400)]
    measured = torch.stack(draws).square().sum(-1).mean(0).reshape(-1) / H  # ‖δ_m‖² ≈ H
    torch.testing.assert_close(gain, measured, rtol=0.15, atol=0)
    assert float((gain / measured).mean()) == pytest.approx(1.0, abs=0.03)


def test_norm_gain_weights_the_sites_dx_rows():
    """dxdxN = Σ_m ‖dx_m‖² κ_m² when a norm's forward hook feeds the site, as refresh.py
    wires it; no norm in front: no dxdxN."""
    torch.manual_seed(3)
    layer = _layer(ColumnParallelLinear)
    norm = torch.nn.RMSNorm(H, eps=1e-5)
    h, r = torch.randn(S, B, H) * 2, torch.randn(S, B, F)
    obs = SiteObserver("L0.fc1", layer, CANDIDATES)
    hook = norm.register_forward_hook(lambda m, inputs, _: obs.norm_forward(m, inputs[0]))
    obs.begin_pass(BASE, [0], B)
    layer.observer = obs
    x = norm(h).detach().requires_grad_()  # the hook fires just before the site's forward
    y, _ = layer(x)
    (y * r).sum().backward()
    hook.remove()
    kappa2 = 1.0 / (h.double().square().mean(-1).reshape(-1) + 1e-5)  # γ = 1
    assert _host(obs.stats)["dxdxN"] == pytest.approx(float((_rows(x.grad) * kappa2).sum()), rel=1e-5)
    plain = SiteObserver("L0.fc1", layer, CANDIDATES)
    _run(layer, plain, x.detach(), r)
    assert _host(plain.stats)["dxdxN"] == 0.0 and _host(plain.stats)["dxdx"] > 0


def _held(obs) -> int:
    """N x K elements the observer still holds (wgrad errors, probe gradients)."""
    errors = [e for errs in obs._wgrad_error.values() for e in errs.values()]
    return sum(t.numel() for t in [*errors, *obs._probe_dg.values()] if torch.is_tensor(t))


def test_adam_known_in_advance_streams_the_same_statistics():
    """A² given before the passes (training's order): every A-weighted statistic equals the
    one of A² given after them (groundtruth's order), and no N x K tensor outlives its
    site's backward; float32 A² (what training keeps) within 1e-6."""
    torch.manual_seed(6)
    layer = _layer(RowParallelLinear)
    x, r = torch.randn(S, B, F), torch.randn(S, B, H)
    a2 = torch.rand(H, F, dtype=torch.float64)
    late = SiteObserver("L0.fc2", layer, CANDIDATES, noise_scale=0.1)
    for mode in (BASE, PROBE_BACKWARD, PROBE_FORWARD):
        _run(layer, late, x, r, mode)
    assert _held(late) == 6 * H * F  # four wgrad errors, dgB and dgF kept until A² comes
    late.adam_weighted(a2)
    for a2_early, rel in ((a2, 1e-12), (a2.float(), 1e-6)):
        early = SiteObserver("L0.fc2", layer, CANDIDATES, noise_scale=0.1)
        early.adam_weighted(a2_early)
        for mode in (BASE, PROBE_BACKWARD, PROBE_FORWARD):
            _run(layer, early, x, r, mode)
            assert _held(early) == 0
        for key, value in _host(late.stats).items():
            expect = value if isinstance(value, dict) else {"": value}
            got = _host(early.stats)[key] if isinstance(value, dict) else {"": _host(early.stats)[key]}
            for f, v in expect.items():
                assert got[f] == pytest.approx(v, rel=rel, abs=1e-300), (key, f)


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_offloaded_base_gradient_and_a2_give_the_same_statistics(offload, tmp_path):
    """``--snip-offload host``: the base gradient waits on the host between passes and ``A²``
    is copied to the weight's device for use; ``disk``: both wait in files, read back at
    each use. Every statistic is bit-identical to keeping them on the model's device (on CPU
    host is the same memory: the copies are exercised); the base gradient's file is gone
    after step 3, and closing the store removes the folder."""
    torch.manual_seed(7)
    layer = _layer(RowParallelLinear)
    x, r = torch.randn(S, B, F), torch.randn(S, B, H)
    a2 = torch.rand(H, F)
    runs = []
    for store in (TensorStore(), TensorStore.for_offload(offload, str(tmp_path))):
        obs = SiteObserver("L0.fc2", layer, CANDIDATES, noise_scale=0.1, store=store)
        obs.adam_weighted(store.put(a2))
        for mode in (BASE, PROBE_BACKWARD, PROBE_FORWARD):
            _run(layer, obs, x, r, mode)
        runs.append(_host(obs.stats))
        assert obs._g_base is None
        if store.folder is not None:
            assert sorted(p.name for p in Path(store.folder).iterdir()) == ["0.pt"]  # A²
        store.close()
    assert runs[0] == runs[1]
    assert runs[0]["dgAF"] > 0 and all(v > 0 for v in runs[0]["WGdy"].values())
    assert list(tmp_path.iterdir()) == []
