"""SNIP against the §6.1 baselines and uniform FP8 / FP4 on the tiny Llama (not a test).

The small-scale version of SNIP's Fig. 8 / Table 1: trains the ``tiny`` Llama from the same
init and data order (one ``--seeds`` value) on the embedded corpus with

* FP32 (no ``--precision``), ``--precision uniform:fp8`` and ``--precision uniform:fp4``;
* for every budget ``E_t`` (``--budgets``) and policy (``--policies``):
  ``--precision POLICY --snip-budget E_t`` with ``--snip-start 20 --snip-interval 50
  --snip-apply-lag 2`` (the statistics policies ``snip``, ``min-abs-err``, ``min-rel-err``
  refresh on that schedule and run the safe FP8 plan before the first one; ``random``,
  ``e-layer-type`` and ``e-layer-id`` solve once at start-up);

then writes ``<out>/results.md`` and ``<out>/results.json``: final validation loss and gap
to the same seed's FP32 run per policy and budget (averaged over the seeds), the smallest gap
per budget in bold, whether SNIP has it, and with several seeds every seed's gaps. It draws
PNGs with ``tools/plot_precision.py`` into ``--img-dir`` from the first seed's runs: loss
curves of the largest budget's runs (Fig. 8; all steps, and the second half zoomed in), the
final plan of ``snip`` / ``min-rel-err`` / ``e-layer-type`` at each budget (Fig. 7), the
last SNIP refresh's divergences (Fig. 10) and the SNIP plan over refreshes (Fig. 11).

    python benchmarks/snip_quality.py --jobs 2                 # the full grid (21 runs)
    python benchmarks/snip_quality.py --jobs 2 --seeds 1234 1235 1236   # 63 runs, 3 seeds
    python benchmarks/snip_quality.py --budgets 0.5 --policies snip random --train-iters 40
    python benchmarks/snip_quality.py --report-only            # table and PNGs from the runs

Every run is a child process (:func:`precision_quality.train`) with its own run directory
``<out>/seed<seed>/<name>``; a run that already finished there is not run again, so an
interrupted grid resumes where it stopped. ``OMP_NUM_THREADS`` is passed on: set it (1 per
job on a small CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from precision_quality import REPO, finished, read_metrics, train

BUDGETS = (0.25, 0.5, 0.75)
POLICIES = ("snip", "random", "min-abs-err", "min-rel-err", "e-layer-type", "e-layer-id")
REFERENCES = ("fp32", "uniform:fp8", "uniform:fp4")
SNIP_SCHEDULE = ["--snip-start", "20", "--snip-interval", "50", "--snip-apply-lag", "2"]
PLAN_POLICIES = ("snip", "min-rel-err", "e-layer-type")
"""Policies whose final plans are drawn at every budget."""
PLOT = REPO / "tools" / "plot_precision.py"
MAX_PNG_BYTES = 60_000


@dataclass(frozen=True)
class Run:
    """One run: a reference (``budget`` None) or a policy at a budget, from one seed."""

    policy: str
    budget: float | None = None
    seed: int = 1234

    @property
    def name(self) -> str:
        base = self.policy.replace(":", "-")
        return base if self.budget is None else f"{base}-{self.budget:g}"

    @property
    def label(self) -> str:
        return "FP32" if self.policy == "fp32" else self.policy

    def parent(self, out: Path) -> Path:
        return out / f"seed{self.seed}"

    def dir(self, out: Path) -> Path:
        """``<out>/seed<seed>/<name>``."""
        return self.parent(out) / self.name

    def flags(self) -> list[str]:
        seed = ["--seed", str(self.seed)]
        if self.policy == "fp32":
            return seed
        if self.budget is None:
            return [*seed, "--precision", self.policy]
        return [*seed, "--precision", self.policy, "--snip-budget", str(self.budget),
                *SNIP_SCHEDULE]


def grid(budgets, policies, seeds) -> list[Run]:
    """Seed by seed: the reference runs, then every policy at every budget."""
    return [run for seed in seeds
            for run in [*(Run(r, seed=seed) for r in REFERENCES),
                        *(Run(p, b, seed) for b in budgets for p in policies)]]


def common_flags(args) -> list[str]:
    """Flags of every run: the precision_quality settings (lr 1e-3 variant), logged per step."""
    return ["--train-iters", str(args.train_iters), "--lr", str(args.lr),
            "--min-lr", str(args.min_lr), "--log-interval", "1",
            "--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters),
            *args.extra]


# ------------------------------------------------------------------------------ running


def say(line: str) -> None:
    """Print one whole line (one write: the jobs' threads do not interleave within it)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_grid(runs: list[Run], args) -> list[str]:
    """Train every run not finished yet, ``--jobs`` at a time, printing progress; returns
    the runs that failed (their logs are ``<out>/seed<seed>/<name>/train.log``)."""
    todo = [r for r in runs if not finished(r.dir(args.out))]
    print(f"{len(runs) - len(todo)} of {len(runs)} runs already finished in {args.out}; "
          f"{len(todo)} to go, {args.jobs} at a time", flush=True)
    start = time.time()
    done = iter(range(1, len(todo) + 1))

    def one(run: Run) -> str | None:
        t0, tag = time.time(), f"seed{run.seed}/{run.name}"
        say(f"start {tag}: {' '.join(run.flags())}")
        try:
            records = train(run.name, [*common_flags(args), *run.flags()],
                            run.parent(args.out), reuse=True)
        except RuntimeError as exc:
            say(f"[{next(done)}/{len(todo)}] {tag} FAILED: {exc}")
            return tag
        say(f"[{next(done)}/{len(todo)}] {tag}: val loss {final_val_loss(records):.4f} "
            f"in {time.time() - t0:.0f} s (elapsed {(time.time() - start) / 60:.1f} min)")
        return None

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return [tag for tag in pool.map(one, todo) if tag]


# ------------------------------------------------------------------------------ results


def final_val_loss(records: list[dict]) -> float:
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    return val[max(val)]


def result_of(run: Run, out: Path) -> dict | None:
    """Final validation loss, final FP4 FLOP fraction and refresh count of a finished run."""
    if not finished(run.dir(out)):
        return None
    records = read_metrics(run.dir(out))
    last = [r for r in records if "loss" in r][-1]
    return {"name": run.name, "seed": run.seed, "policy": run.policy, "budget": run.budget,
            "val_loss": final_val_loss(records), "fp4_flop_frac": last.get("fp4_flop_frac", 0.0),
            "refreshes": sum("snip_refresh" in r for r in records)}


class Results:
    """Finished runs, compared with FP32 seed by seed (only seeds whose FP32 run finished)."""

    def __init__(self, runs: list[Run], out: Path):
        self.by_run = {r: res for r in runs if (res := result_of(r, out))}
        self.seeds = sorted({r.seed for r in self.by_run if r.policy == "fp32"})

    def losses(self, policy: str, budget: float | None) -> dict[int, float]:
        """Seed -> final validation loss, for the seeds with an FP32 run."""
        return {s: self.by_run[Run(policy, budget, s)]["val_loss"] for s in self.seeds
                if Run(policy, budget, s) in self.by_run}

    def gaps(self, policy: str, budget: float | None) -> dict[int, float]:
        """Seed -> loss minus that seed's FP32 loss."""
        fp32 = self.losses("fp32", None)
        return {s: v - fp32[s] for s, v in self.losses(policy, budget).items()}

    def mean_gap(self, policy: str, budget: float | None) -> tuple[float, float] | None:
        """(mean loss, mean gap) over the seeds this run finished; None if none did."""
        losses, gaps = self.losses(policy, budget), self.gaps(policy, budget)
        if not losses:
            return None
        return statistics.mean(losses.values()), statistics.mean(gaps.values())

    def fp4(self, policy: str, budget: float | None) -> float | None:
        values = [r["fp4_flop_frac"] for run, r in self.by_run.items()
                  if (run.policy, run.budget) == (policy, budget)]
        return statistics.mean(values) if values else None

    def to_json(self) -> list[dict]:
        return list(self.by_run.values())


def gap_text(gap: float, base: float) -> str:
    """``+0.0123 (+0.22 %)``: absolute and relative to ``base`` (the FP32 loss)."""
    return f"{gap:+.4f} ({100 * gap / base:+.2f} %)"


def fp32_mean(results: Results) -> float:
    return statistics.mean(results.losses("fp32", None).values())


def reference_table(results: Results) -> list[str]:
    seeds, base = results.seeds, fp32_mean(results)
    lines = ["| run | FP4 FLOP fraction | " + " | ".join(f"seed {s}" for s in seeds)
             + " | mean | gap to FP32 (mean) |", "|---|---|" + "---|" * (len(seeds) + 2)]
    for name in REFERENCES:
        losses = results.losses(name, None)
        if not losses:
            continue
        mean, gap = results.mean_gap(name, None)
        cells = [f"{losses[s]:.4f}" if s in losses else "-" for s in seeds]
        gap_cell = "" if name == "fp32" else gap_text(gap, base)
        lines.append(f"| {Run(name).label} | {results.fp4(name, None):.2f} | "
                     + " | ".join(cells) + f" | {mean:.4f} | {gap_cell} |")
    return lines


def best_per_budget(results: Results, budgets, policies) -> dict:
    """Budget -> the policy with the lowest mean gap to FP32 (finished runs only)."""
    best = {}
    for b in budgets:
        done = [p for p in policies if results.mean_gap(p, b)]
        if done:
            best[b] = min(done, key=lambda p: results.mean_gap(p, b)[1])
    return best


def grid_table(results: Results, budgets, policies, best: dict) -> list[str]:
    base = fp32_mean(results)
    what = "val loss, gap to FP32" + (" (means)" if len(results.seeds) > 1 else "")
    lines = ["| policy | " + " | ".join(f"E_t = {b:g}: {what}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for p in policies:
        cells = []
        for b in budgets:
            cell = results.mean_gap(p, b)
            text = f"{cell[0]:.4f}, {gap_text(cell[1], base)}" if cell else "not run"
            cells.append(f"**{text}**" if best.get(b) == p else text)
        lines.append(f"| `{p}` | " + " | ".join(cells) + " |")
    return lines


def seed_gap_table(results: Results, budgets, policies) -> list[str]:
    """Relative gap to FP32 of every seed (``seed1 / seed2 / ...``), policy x budget."""
    fp32 = results.losses("fp32", None)
    lines = ["| policy | " + " | ".join(f"E_t = {b:g}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for p in [*REFERENCES[1:], *policies]:
        budget_list = [None] if p in REFERENCES else budgets
        cells = []
        for b in budget_list:
            gaps = results.gaps(p, b)
            cells.append(" / ".join(f"{100 * gaps[s] / fp32[s]:+.2f}" if s in gaps else "-"
                                    for s in results.seeds) + " %")
        if p in REFERENCES:
            cells = [cells[0]] + ["(same)"] * (len(budgets) - 1)
        lines.append(f"| `{p}` | " + " | ".join(cells) + " |")
    return lines


def seed_winners(results: Results, budget: float, policies) -> dict[int, str]:
    """Seed -> the policy with the smallest gap at ``budget`` (seeds where all finished)."""
    out = {}
    for s in results.seeds:
        gaps = {p: results.gaps(p, budget).get(s) for p in policies}
        if None not in gaps.values():
            out[s] = min(gaps, key=gaps.get)
    return out


def paired(results: Results, budget: float, a: str, b: str) -> str:
    """``; paired over N seeds, a - b = +x ± se (standard error)``; empty for one seed."""
    ga, gb = results.gaps(a, budget), results.gaps(b, budget)
    diffs = [ga[s] - gb[s] for s in ga if s in gb]
    if len(diffs) < 2:
        return ""
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    return (f"; paired over {len(diffs)} seeds, `{a}` - `{b}` = "
            f"{statistics.mean(diffs):+.4f} ± {se:.4f} (standard error)")


def seed_spread(results: Results, budgets, policies) -> str:
    """The median over cells of the seed-to-seed standard deviation of the gap (relative)."""
    fp32 = results.losses("fp32", None)
    spreads = []
    for p, b in [*((r, None) for r in REFERENCES[1:]), *((p, b) for p in policies
                                                         for b in budgets)]:
        gaps = results.gaps(p, b)
        if len(gaps) > 1:
            spreads.append(statistics.stdev(100 * g / fp32[s] for s, g in gaps.items()))
    if not spreads:
        return ""
    return (f"Seed-to-seed standard deviation of one run's gap to FP32: median "
            f"{statistics.median(spreads):.2f} percentage points over the cells "
            f"(range {min(spreads):.2f}-{max(spreads):.2f}).")


def verdicts(results: Results, budgets, policies, best: dict) -> list[str]:
    """One plain sentence per budget: does SNIP have the smallest gap to FP32?"""
    lines, base = [], fp32_mean(results)
    for b in budgets:
        if "snip" not in policies or not results.mean_gap("snip", b) or b not in best:
            continue
        ranked = sorted((p for p in policies if results.mean_gap(p, b)),
                        key=lambda p: results.mean_gap(p, b)[1])
        snip = results.mean_gap("snip", b)[1]
        wins = seed_winners(results, b, policies)
        seeds = (f" SNIP has the smallest gap on {sum(w == 'snip' for w in wins.values())} of "
                 f"{len(wins)} seeds." if len(wins) > 1 else "")
        if best[b] == "snip":
            runner = ranked[1] if len(ranked) > 1 else None
            margin = (f"; next: `{runner}`, {results.mean_gap(runner, b)[1] - snip:+.4f} more"
                      + paired(results, b, "snip", runner) if runner else "")
            lines.append(f"- E_t = {b:g}: **yes**, SNIP has the smallest gap "
                         f"({gap_text(snip, base)}){margin}.{seeds}")
        else:
            top = results.mean_gap(best[b], b)[1]
            lines.append(f"- E_t = {b:g}: **no**, `{best[b]}` has the smallest gap "
                         f"({gap_text(top, base)}); SNIP ranks {ranked.index('snip') + 1} of "
                         f"{len(ranked)} ({gap_text(snip, base)}, {snip - top:+.4f} more)"
                         f"{paired(results, b, 'snip', best[b])}.{seeds}")
    return lines


def fp4_table(results: Results, budgets, policies) -> list[str]:
    lines = ["| policy | " + " | ".join(f"E_t = {b:g}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for p in policies:
        cells = [f"{v:.3f}" if (v := results.fp4(p, b)) is not None else "-" for b in budgets]
        lines.append(f"| `{p}` | " + " | ".join(cells) + " |")
    return lines


def report(args) -> str:
    """The Markdown report of the finished runs (also written to ``<out>/results.md``)."""
    results = Results(grid(args.budgets, args.policies, args.seeds), args.out)
    (args.out / "results.json").write_text(json.dumps(results.to_json(), indent=1) + "\n")
    if not results.seeds:
        return "No FP32 run finished: no gaps to report.\n"
    best = best_per_budget(results, args.budgets, args.policies)
    many = len(results.seeds) > 1
    parts = [f"Final validation loss after {args.train_iters} steps (seeds "
             f"{', '.join(map(str, results.seeds))}; lr {args.lr:g} -> {args.min_lr:g} cosine, "
             f"{args.eval_iters} validation batches); gap = loss - FP32 loss of the same seed"
             + (", averaged over the seeds" if many else "") + " (and relative to FP32).", "",
             *reference_table(results), "",
             "Smallest gap per budget in bold:", "",
             *grid_table(results, args.budgets, args.policies, best), "",
             "Does SNIP have the smallest gap?", "",
             *verdicts(results, args.budgets, args.policies, best), ""]
    if many:
        parts += ["Gap to FP32 per seed (" + " / ".join(map(str, results.seeds)) + "):", "",
                  *seed_gap_table(results, args.budgets, args.policies), "",
                  seed_spread(results, args.budgets, args.policies), ""]
    parts += ["FP4 fraction of linear-layer FLOPs of the final plan"
              + (" (mean over seeds)" if many else "") + ":", "",
              *fp4_table(results, args.budgets, args.policies)]
    text = "\n".join(parts) + "\n"
    (args.out / "results.md").write_text(text)
    return text


# ------------------------------------------------------------------------------ figures


def plot(command: list[str], out: Path) -> None:
    """``tools/plot_precision.py COMMAND... --out out``, then :func:`shrink_png`; warns when
    the PNG is still too large for the docs."""
    subprocess.run([sys.executable, str(PLOT), *command, "--out", str(out)], check=True,
                   cwd=REPO)
    shrink_png(out)
    if out.stat().st_size > MAX_PNG_BYTES:
        print(f"warning: {out} is {out.stat().st_size // 1000} KB", flush=True)


def shrink_png(path: Path) -> None:
    """Re-save as a 256-colour palette PNG (a third of the size; these figures use a few
    dozen colours plus antialiasing)."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256)
    tmp = path.with_name(f".{path.name}.tmp")
    small.save(tmp, format="PNG", optimize=True)
    tmp.replace(path)


def last_refresh(run_dir: Path) -> Path | None:
    steps = sorted((run_dir / "snip").glob("step_*/divergence.json"))
    return steps[-1] if steps else None


def loss_figure(args, img: Path) -> None:
    """Loss curves of the references and every policy at the largest budget, first seed."""
    budget, seed = max(args.budgets), args.seeds[0]
    runs = [r for r in [*(Run(x, seed=seed) for x in REFERENCES),
                        *(Run(p, budget, seed) for p in args.policies)]
            if finished(r.dir(args.out))]
    if not runs:
        return
    command = ["loss", *(str(r.dir(args.out)) for r in runs),
               "--labels", ",".join(r.label for r in runs), "--smooth", "10"]
    plot(command, img / f"loss_budget_{budget:g}.png")
    plot([*command, "--from-step", str(args.train_iters // 2)],
         img / f"loss_budget_{budget:g}_end.png")


def plan_figures(args, img: Path) -> None:
    for policy in (p for p in PLAN_POLICIES if p in args.policies):
        for b in args.budgets:
            plan = Run(policy, b, args.seeds[0]).dir(args.out) / "precision_plan.json"
            if plan.exists():
                plot(["plan", str(plan)], img / f"plan_{policy}_{b:g}.png")


def snip_figures(args, img: Path) -> None:
    """Divergences of the last refresh and the plan over refreshes: the largest budget's SNIP
    run of the first seed."""
    if "snip" not in args.policies:
        return
    run_dir = Run("snip", max(args.budgets), args.seeds[0]).dir(args.out)
    divergence = last_refresh(run_dir)
    if divergence is None:
        return
    for metric in ("dL", "dW"):
        plot(["divergence", str(divergence), "--metric", metric],
             img / f"divergence_{metric}.png")
    plot(["evolution", str(run_dir)], img / f"evolution_snip_{max(args.budgets):g}.png")


def figures(args) -> None:
    img = args.img_dir or args.out / "img"
    img.mkdir(parents=True, exist_ok=True)
    for draw in (loss_figure, plan_figures, snip_figures):
        draw(args, img)


# ------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "snip_quality",
                   help="run directories <out>/seed<seed>/<name> (default runs/snip_quality)")
    p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS), metavar="E_t")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                   metavar="POLICY", help=f"of: {', '.join(POLICIES)}")
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234], metavar="SEED",
                   help="the whole grid per seed (same init and data order within a seed); "
                        "several give the seed spread, the table then shows means")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=10,
                   help="validation batches (10: precision_quality's default)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--img-dir", type=Path, default=None, help="PNGs here (default <out>/img)")
    p.add_argument("--no-plots", action="store_true", help="table only")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: table and PNGs from the finished runs")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="further pretrain flags for every run (put last)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out = args.out.resolve()
    runs = grid(args.budgets, args.policies, args.seeds)
    failed = [] if args.report_only else run_grid(runs, args)
    print("\n" + report(args), flush=True)
    if not args.no_plots:
        figures(args)
    if failed:
        sys.exit(f"failed runs (see their train.log): {', '.join(failed)}")


if __name__ == "__main__":
    main()
