"""``OUT/results.md``: the results mapping (:mod:`.results`) as Markdown tables."""

from __future__ import annotations

import shlex


def _pm(value: float, se: float | None, signed: bool = False) -> str:
    """``5.6123 ± 0.0040`` (``± n/a`` without a standard error)."""
    text = f"{value:+.4f}" if signed else f"{value:.4f}"
    return f"{text} ± {se:.4f}" if se is not None else f"{text} ± n/a"


def _t(diff: dict) -> str:
    """``t +2.23, 4 df, p 0.090`` (n/a with one seed; ``t n/a`` when every difference is 0)."""
    if diff["df"] is None:
        return "n/a"
    t = "n/a" if diff["t"] is None else f"{diff['t']:+.2f}"
    return f"t {t}, {diff['df']} df, p {diff['p']:.3f}"


def _group(group: str | None) -> str:
    return "—" if group is None else f"`{group}`"


def _header(results: dict) -> list[str]:
    grid = results["grid"]
    steps = sorted({s["train_iters"] for run in results["runs"].values()
                    for s in run["seeds"].values()})
    lines = [f"# Precision comparison: {len(grid['runs'])} runs x {len(grid['seeds'])} seed(s)",
             "", f"`{grid['entry']}` with base flags `{shlex.join(grid['base_flags'])}`; seeds "
             f"{', '.join(map(str, grid['seeds']))}.",
             f"Score: validation loss at the last step ({'/'.join(map(str, steps))}); "
             "± = standard error over the seeds."]
    if grid["reference"]:
        lines.append(f"Δ = paired difference run − `{grid['reference']}` on the same seed, "
                     "± its standard error; Δ % relative to the reference's mean loss; "
                     "t = Δ / standard error, Student's paired t test with its degrees of "
                     "freedom and two-sided p; verdict: `lower` / `higher` "
                     "at p < 0.05 with ≥ 5 seeds, else not separable with the 95 % "
                     "interval (`megatron_ext/compare/stats.py`).")
    within = f" within its `{grid['group_by']}` group" if grid["group_by"] else ""
    lines += [f"Rank 1 = lowest mean loss{within}. FP4 = FP4 share of the linear-layer FLOPs "
              "of the final plan (mean over the logged steps); GEMM saving = 1 − the cost "
              "model's GEMM time relative to all-BF16 (mean over the logged steps); peak mem = the "
              "largest `mem_gib` logged by rank 0 over the seeds (peak RSS of the process on "
              "CPU, allocated tensor memory on GPU).", ""]
    return lines


def _main_table(results: dict) -> list[str]:
    grid = results["grid"]
    ref = grid["reference"]
    cols = ["run", *(["group"] if grid["group_by"] else []), "rank", "val loss",
            *([f"Δ vs `{ref}`", "Δ %", "t test", "verdict"] if ref else []), "FP4 final (mean)",
            "GEMM saving", "peak mem GiB"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, run in results["runs"].items():
        cells = [f"`{name}`", *([_group(run["group"])] if grid["group_by"] else []),
                 str(run["rank"]), _pm(run["val_loss"]["mean"], run["val_loss"]["se"])]
        if ref:
            diff = run["vs_reference"]
            cells += [_pm(diff["mean"], diff["se"], True), f"{diff['rel_pct']:+.2f} %",
                      _t(diff), diff["verdict"]] if diff else ["(reference)", "", "", ""]
        cells += [f"{run['fp4_flop_frac']:.3f} ({run['fp4_flop_frac_mean']:.3f})",
                  f"{100 * run['gemm_time_saving']:.1f} %",
                  "n/a" if run.get("mem_gib") is None else f"{run['mem_gib']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _seed_table(results: dict) -> list[str]:
    seeds = [str(s) for s in results["grid"]["seeds"]]
    ref = results["grid"]["reference"]
    cols = ["run", *(f"seed {s}" for s in seeds), *(f"Δ seed {s}" for s in seeds if ref)]
    lines = ["## Per seed", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, run in results["runs"].items():
        cells = [f"`{name}`", *(f"{run['seeds'][s]['val_loss']:.4f}" for s in seeds)]
        if ref:
            diff = run["vs_reference"]
            cells += [f"{diff['diffs'][s]:+.4f}" if diff else "—" for s in seeds]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _group_lines(results: dict) -> list[str]:
    flag = results["grid"]["group_by"]
    lines = ["## Ranking per group" if flag else "## Ranking", ""]
    for group in results["groups"]:
        order = ", ".join(f"{i}. `{n}`" for i, n in
                          ((results["runs"][n]["rank"], n) for n in group["ranking"]))
        label = (f"`{flag} {group['group']}`" if group["group"] is not None else
                 f"without `{flag}`" if flag else "all runs")
        margin = group["margin"]
        lead = "" if margin is None else (
            f"; runner-up − best = {_pm(margin['mean'], margin['se'], True)} "
            f"({_t(margin)}, paired: {margin['verdict']})")
        wins = list(group["best_per_seed"].values()).count(group["ranking"][0])
        lines.append(f"- {label}: {order}{lead}; `{group['ranking'][0]}` is best on {wins} "
                     f"of {len(group['best_per_seed'])} seeds")
    return lines


def _draw_lines(results: dict) -> list[str]:
    ref = results["grid"]["reference"]
    lines = []
    for fam in results.get("draws", []):
        diff = fam["draws_minus_reference"]
        places = ", ".join(f"{s}: {k}" for s, k in fam["place"].items())
        lines.append(f"- `{fam['family']}` ({len(fam['runs'])} draws per seed): `{ref}`'s place "
                     f"among them per seed ({places}; 0 = better than every draw), permutation "
                     f"p {fam['permutation_p']:.3f}; mean of the draws − `{ref}` = "
                     f"{_pm(diff['mean'], diff['se'], True)} ({_t(diff)})")
    return ["## Random draws", "", *lines] if lines else []


def markdown(results: dict, figures: list[str]) -> str:
    """The whole report; ``figures`` are PNG paths relative to ``OUT``."""
    runs = ["## Runs", "", *(f"- `{n}`: `{shlex.join(r['flags']) or '(base flags only)'}`"
                             for n, r in results["runs"].items())]
    pictures = ["## Figures", "", *(f"![{f}]({f})" for f in figures)] if figures else []
    parts = [_header(results), _main_table(results), _seed_table(results),
             _group_lines(results), _draw_lines(results), runs, pictures]
    return "\n\n".join("\n".join(p) for p in parts if p) + "\n"
