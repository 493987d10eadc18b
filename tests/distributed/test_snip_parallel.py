"""SNIP under TP=2 x PP=2 x DP=2 (8 processes, torchrun on gloo) against one process on the
same global batch: the reduced statistics of a refresh, and the plan every rank applies. The
8-process run also observes its sites in groups (``--snip-sites-per-pass 3``: 3 groups of the
three passes on each stage), which must change no statistic."""

import json

import pytest

from pretrain_runner import FAST_ARGS, launch, read_metrics

# every 128-tile inside one TP=2 shard: qkv 768 rows -> 384, fc1 1024 -> 512, proj and fc2
# input columns 256 -> 128 and 512 -> 256; a micro-batch is 2 x 64 = 128 tokens (wgrad tiles)
ALIGNED = ["--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
           "--num-query-groups", "4"]
SNIP = ["--precision", "snip", "--snip-budget", "0.5", "--snip-start", "2",
        "--snip-stage-balance", "none",  # the same ILP rows at PP=1 and PP=2
        "--snip-interval", "0", "--snip-apply-lag", "1",
        # unquantized until the plan (quantization would turn 1e-7 differences between
        # layouts into rounding flips), nearest rounding only: no layout-dependent draws
        "--snip-candidates", "none,fp4_e2m1@tile128"]


def _run(tmp_path, name, nproc, *flags):
    run_dir = tmp_path / name
    launch([*FAST_ARGS, *ALIGNED, *SNIP, "--train-iters", "4", "--no-save",
            "--run-dir", str(run_dir), *flags], nproc=nproc, timeout=900)
    out = run_dir / "snip" / "step_000002"
    stats = json.loads((out / "stats.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    hashes = [r["precision_plan"] for r in read_metrics(run_dir) if "loss" in r]
    return stats, plan, hashes


def _flatten(stats: dict) -> dict:
    flat = {}
    for site in stats["sites"]:
        for key, value in site["stats"].items():
            for fmt, v in (value.items() if isinstance(value, dict) else [("", value)]):
                flat[f"{site['site']}.{key}.{fmt}"] = v
    return flat


LAYOUTS = {
    "tp2pp2dp2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--use-distributed-optimizer", "--snip-sites-per-pass", "3"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("snip_parallel")
    out = {"single": _run(tmp, "single", 1)}
    for name, (nproc, flags) in LAYOUTS.items():
        out[name] = _run(tmp, name, nproc, *flags)
    return out


# The layouts sum in other orders: their float32 operands and gradients differ by ~1e-7
# relative (one to a few ulps). Two kinds of statistics amplify that:
#
# * continuous, ill-conditioned: the forward probe's dgF = ‖g_probe - g_base‖², a difference
#   of two fp32 gradients where the noise is 1e-2 of the signal: a sum of 512 tokens is off
#   by ~√512·2⁻²⁴ ≈ 1.3e-6 of |g| (rms), 1.3e-4 of the difference, 2.7e-4 of its square;
#   AdamW's A = 1/(√v + ε) with v ≈ 0 (AA, and the A²-weighted dgAB dgAF) adds the relative
#   error of the smallest gradients. Measured (Intel Xeon 2026-11-23 / AMD EPYC 2026-11-26):
#   dgF 2e-4 / 6.8e-4, dgAF 8e-4 / 1.5e-3, dgAB 8e-5 / 1.3e-4, AA 1e-5 / 2e-5.
# * discontinuous, the exact error GEMMs WGdy WGx Bw Bdyw (signed sums of rounding errors):
#   an operand element that moves by an ulp across an FP4 rounding midpoint flips its error
#   by a grid step h (its square, all the random-sign forms saw, is continuous there). One
#   flip at token m, column k changes the error GEMM's column k by h·dy_m: relative to ‖E‖²,
#   2·√12/(√M·K) with M = 512 tokens, K = 256-512 columns, errors uniform in ±h/2 — 6e-4 to
#   1.2e-3, more where A² weights few columns. Measured single flips: 1.1e-3 (WGdy, AMD),
#   1e-3 (WGx, another AMD EPYC), 5e-4 (WGdy, Intel). E2M1's midpoints lie 1/3 to 1 of a
#   value apart, so an element lands within 1e-7 of one with probability ~3e-7: ~0.05 flips
#   per operand of 1.3-2.6e5 elements; dy, at the end of the backward chain, differs by more
#   (measured: 5 of 16 sites' WGdy moved by a flip's worth, ~0.3 a site), and four flips of
#   one sign in one operand at that rate have probability ~1e-5.
#
# Hence the bounds below (about 3x the largest measured; the error GEMMs four same-sign
# flips). A layout error (a replica counted twice, a missing TP / DP completion) is a factor
# of 2, 100x outside every bound; everything else is a sum of squares within 1e-5.
FLIP = 5e-3
ILL_CONDITIONED = {"dgF": 2e-3, "dgAB": 1e-3, "dgAF": 5e-3, "AA": 1e-4,
                   "WGdy": FLIP, "WGx": FLIP, "Bw": FLIP, "Bdyw": FLIP}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_statistics_equal_the_single_process_run(runs, layout):
    (single, _, _), (parallel, _, _) = runs["single"], runs[layout]
    a, b = _flatten(single), _flatten(parallel)
    assert a.keys() == b.keys() and len(a) > 16 * 20
    assert parallel["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert parallel["adam"] == pytest.approx(single["adam"], rel=1e-6)
    bad = {k: (a[k], b[k]) for k in a
           if b[k] != pytest.approx(a[k], rel=ILL_CONDITIONED.get(k.split(".")[2], 1e-5),
                                    abs=1e-30)}
    assert not bad, f"{len(bad)} statistics differ, e.g. {list(bad.items())[:5]}"
    # the residual-stream terms exist wherever a norm feeds the site
    assert all(a[f"L{i}.{site}.{key}."] > 0 for i in range(4) for site in ("qkv", "fc1")
               for key in ("dxdxN", "resB"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_applies_the_single_process_plan(runs, layout):
    (_, plan1, hashes1), (_, plan_n, hashes_n) = runs["single"], runs[layout]
    assert plan_n["sites"] == plan1["sites"]  # (the hash differs: it holds per-stage fractions)
    for hashes in (hashes1, hashes_n):
        assert hashes[3] != hashes[2] == hashes[0]  # safe plan, then applied before step 4
