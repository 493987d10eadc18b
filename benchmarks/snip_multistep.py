"""SNIP's one-step ΔW against an N-step ground truth in the comparison regime (not a test).

    python benchmarks/snip_multistep.py --run-dir runs/ms_1234 --load-step 20
    python benchmarks/snip_multistep.py --run-dir runs/ms_1235 --load-step 20 \\
        --model-args "--seed 1235" --sites L0.qkv,L0.fc1,L3.fc1 --steps 1,10,50
    python benchmarks/snip_multistep.py --run-dir runs/ms_1235 --model-args "--seed 1235" \\
        --reestimate runs/ms_1235.json     # no trajectories: the one-step estimate again

Trains the tiny Llama of ``examples/compare/snip_regime.yaml`` (FP32, lr 1e-3 → 1e-4 over
200 steps) into ``--run-dir`` with a checkpoint every 20 steps up to the largest
``--load-step`` (skipped when the checkpoint is there), loads the one of ``--load-step`` in
this process and runs :func:`megatron_ext.methods.snip.multistep.measure`: per site and
option (``dy`` in FP4, ``xw``: x and w in FP4, ``all``: the whole site; the regime's FP8 elsewhere in
the site), N steps of training against N unquantized ones. Prints per option how the effect
grows with N (slope of log effect vs log N: 1 coherent, 0.5 random walk), the rank
correlation of SNIP's one-step estimate with the N-step truth, and the ILP's plan at
``--budget`` with ΔW weighted 1 (the paper's Q) and by the measured growth. With
``--reestimate JSON`` (an earlier ``--json``) it only re-runs the refresh and compares the
one-step ΔW estimate with that run's measured one-step ΔW, with a forward error reaching the
sites at or below the quantized one (the paper's) and every site (:func:`reach_table`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.snip_estimator import load_run  # noqa: E402

REGIME = "--model tiny --train-iters 200 --lr 1e-3 --min-lr 1e-4".split()
"""examples/compare/snip_regime.yaml's base flags (its fp32 reference run)."""
CANDIDATES = "fp8,fp4-tensor"
"""The regime's ``--snip-candidates``: high, low."""
OPTIONS = {"dy": ("dy",), "xw": ("x", "w"), "all": ("x", "w", "dy")}
"""Option name -> the roles in the low format (the others high); ``--options`` picks."""


def option_formats(name: str):
    """The SiteFormats of option ``name`` of :data:`OPTIONS`."""
    from megatron_ext.methods.snip.candidates import parse_candidates
    from megatron_ext.precision.site_formats import SiteFormats
    per_role = parse_candidates(CANDIDATES).all_formats()
    return SiteFormats(*(per_role[r][1 if r in OPTIONS[name] else 0] for r in ("x", "w", "dy")))


def _train(run_dir: Path, until: int, extra: list[str]) -> None:
    cmd = [sys.executable, str(REPO / "pretrain_llama.py"), *REGIME, "--eval-iters", "0",
           "--log-interval", "10", "--save-interval", "20", "--exit-interval", str(until),
           "--run-dir", str(run_dir), *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)


def _spearman(a, b) -> float:
    from scipy.stats import spearmanr
    return float(spearmanr(a, b).statistic)


def summarize(truth) -> dict:
    """Per option: median growth exponents of dW and |dloss_plan| over the sites, and the
    Spearman of the one-step estimate with the truth at each N; pooled over the options:
    Spearman of Q = ΔL + w ΔW with the N-step loss change, w = 1 and w = N."""
    from megatron_ext.methods.snip.multistep import growth_exponent
    out = {"options": {}, "pooled": {}}
    for i, name in enumerate(truth.options):
        dw, dl = truth.dW[i], truth.dloss_plan[i]
        out["options"][name] = {
            "slope_dW": float(np.nanmedian([growth_exponent(truth.steps, r) for r in dw])),
            "slope_dloss": float(np.nanmedian([growth_exponent(truth.steps, r) for r in dl])),
            "spearman_dW": [_spearman(truth.est_dW[i], [r[n] for r in dw])
                            for n in range(len(truth.steps))]}
    for n, steps in enumerate(truth.steps):
        true = [truth.dloss_plan[i][j][n] for i in range(len(truth.options))
                for j in range(len(truth.sites))]
        for w in sorted({1, steps}):
            est = [truth.est_dL[i][j] + w * truth.est_dW[i][j]
                   for i in range(len(truth.options)) for j in range(len(truth.sites))]
            out["pooled"][f"N={steps} w={w}"] = _spearman(est, true)
    return out


def reach_table(truth: dict, refresh) -> dict:
    """Per option of an earlier run's ``truth`` and per forward reach
    (:data:`~megatron_ext.methods.snip.divergence.FORWARD_REACH`): the measured one-step ΔW
    over SNIP's estimate for each site, and the Spearman of the two."""
    from megatron_ext.methods.snip.divergence import FORWARD_REACH, weight_divergences
    stats, _, hyper = refresh
    rows = [[s.site for s in stats].index(sid) for sid in truth["sites"]]
    one = truth["steps"].index(1)
    out = {}
    for i, name in enumerate(truth["options"]):
        measured = [dw[one] for dw in truth["dW"][i]]
        for reach in FORWARD_REACH:
            est = weight_divergences(stats, [option_formats(name)], hyper,
                                     forward_reach=reach)[rows, 0]
            out[f"{name} {reach}"] = {"spearman": _spearman(est, measured),
                                      "measured/est": [m / e for m, e in zip(measured, est)]}
    return out


def ilp_plans(args, refresh, budget: float, weights: list[float]) -> dict:
    """The ILP's plan at ``budget`` from ``refresh`` with Q = ΔL + w ΔW for each w."""
    from megatron_ext.methods.snip.candidates import parse_candidates
    from megatron_ext.methods.snip.extension import solve_plan
    from megatron_ext.methods.snip.flags import SnipConfig
    from megatron_ext.methods.snip.candidates import option_name
    stats, loss, hyper = refresh
    cands = parse_candidates(CANDIDATES)
    out = {}
    for w in weights:
        config = SnipConfig("snip", cands.all_formats(), tuple(cands.options()), budget,
                            weights=(1.0, w))
        plan, solution, *_ = solve_plan(config, args, "snip", stats, 0, loss, hyper)
        out[f"w={w:g}"] = {sid: option_name(f) for sid, f in plan.sites.items()
                          if "fp4" in option_name(f)}
    return out


def _report(truth, summary: dict, plans: dict) -> None:
    print(f"steps N {truth.steps}; reference held-out loss {truth.ref_loss}")
    for i, name in enumerate(truth.options):
        print(f"option {name}: est dL / est dW / measured dW at N / dloss_plan at N")
        for j, sid in enumerate(truth.sites):
            print(f"  {sid:8} {truth.est_dL[i][j]:9.3e} {truth.est_dW[i][j]:9.3e} "
                  + " ".join(f"{v:9.3e}" for v in truth.dW[i][j]) + " | "
                  + " ".join(f"{v:+9.2e}" for v in truth.dloss_plan[i][j]))
        s = summary["options"][name]
        print(f"  median slope dW {s['slope_dW']:.2f}, |dloss| {s['slope_dloss']:.2f}; "
              "Spearman est dW vs dW(N) " + " ".join(f"{v:.2f}" for v in s["spearman_dW"]))
    for key, rho in summary["pooled"].items():
        print(f"pooled Spearman of dL + w dW with dloss_plan, {key}: {rho:.3f}")
    for key, plan in plans.items():
        print(f"ILP plan, ΔW weight {key}: {plan}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, help="train into / load from this directory")
    p.add_argument("--load-step", type=int, default=20, help="checkpoint step to start from")
    p.add_argument("--steps", default="1,10,50", help="the N to measure after, comma-separated")
    p.add_argument("--sites", default="", help="site ids, comma-separated (default: all 16)")
    p.add_argument("--options", default="dy,xw", help=f"comma-separated subset of "
                   f"{list(OPTIONS)}: dy, x and w, or all three in FP4")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out global batches")
    p.add_argument("--budget", type=float, default=0.25, help="E_t of the ILP what-if")
    p.add_argument("--weights", default="1,10,50", help="ΔW weights w of the ILP what-if")
    p.add_argument("--model-args", default="", help="extra pretrain flags, one string")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--reestimate", default=None, metavar="JSON",
                   help="no trajectories: compare the one-step ΔW estimate, with the forward "
                        "error reaching the sites at or below the quantized one (the paper's) "
                        "and every site, with the measured one-step ΔW of this earlier --json "
                        "(the same --run-dir, --load-step and --model-args)")
    opts = p.parse_args(argv)
    from megatron_ext.methods.snip.candidates import parse_candidates
    from megatron_ext.methods.snip.multistep import measure, refresh_at

    extra, run_dir = opts.model_args.split(), Path(opts.run_dir)
    ckpt = run_dir / "checkpoints" / f"iter_{opts.load_step:07d}"
    if not ckpt.exists():
        _train(run_dir, opts.load_step, extra)
    args, run = load_run(ckpt, run_dir / "multistep", [*REGIME, *extra])
    refresh = refresh_at(args, run, parse_candidates(CANDIDATES).all_formats(), 1e-2)
    if opts.reestimate:
        table = reach_table(json.loads(Path(opts.reestimate).read_text())["truth"], refresh)
        for key, row in table.items():
            print(f"{key:10} Spearman {row['spearman']:+.2f}; measured / est. ΔW after one "
                  "step: " + " ".join(f"{v:.2f}" for v in row["measured/est"]))
        return 0
    names = opts.options.split(",")
    if not set(names) <= set(OPTIONS):
        p.error(f"--options: expected names of {list(OPTIONS)}, got {opts.options!r}")
    sites = opts.sites.split(",") if opts.sites else [s.site for s in refresh[0]]
    truth = measure(args, run, refresh, {n: option_formats(n) for n in names}, sites,
                    [int(v) for v in opts.steps.split(",")], opts.eval_batches)
    summary = summarize(truth)
    plans = ilp_plans(args, refresh, opts.budget, [float(w) for w in opts.weights.split(",")])
    _report(truth, summary, plans)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"truth": dataclasses.asdict(truth),
                                               "summary": summary, "plans": plans}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
