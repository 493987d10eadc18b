"""Per-run metrics of a comparison grid beyond the final validation loss (not a test).

    python benchmarks/claims_metrics.py runs/gnmr_act4 --reference fp32 \
        --metric gnmr_exceed_alpha gnmr_unit_steps_high --max-loss-after 20

Reads ``DIR/runs/<run>/seed_<s>/metrics.jsonl`` of ``tools/compare_precision.py`` (finished or
not). For every run: the seeds found with their last step, the last validation loss (mean ±
standard error) and its paired difference against ``--reference`` over the seeds both have
(``megatron_ext.compare.stats``: t, df, two-sided p, signs and the verdict on the claimed sign
``--expected``; only seeds that reached the same last validation step), the largest
training loss after step ``--max-loss-after`` (mean over seeds; the paper's "max loss" view
of a spike), and each ``--metric``'s value at the last step that logged it (mean over seeds,
per seed in brackets).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ext.compare.stats import (describe, mean, paired, place_among_draws,  # noqa: E402
                                        standard_error, verdict)


EXPECTED = {"+": 1, "-": -1, "0": 0}
"""--expected's choices as the verdict's expected sign."""


def read(path: Path) -> list[dict]:
    """The records of one metrics.jsonl (a torn last line is skipped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def summarise(records: list[dict], metrics: list[str], after: int) -> dict:
    """Last step, last validation (step, loss), max training loss after ``after``, metrics."""
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    train = [r["loss"] for r in records if "loss" in r and r["step"] > after]
    last = {m: r[m] for r in records for m in metrics if m in r}
    return {"step": max((r.get("step", 0) for r in records), default=0),
            "val": val[-1] if val else None, "max_loss": max(train) if train else None,
            **{m: last.get(m) for m in metrics}}


def fmt(values: list[float], digits: int = 4) -> str:
    se = standard_error(values)
    return f"{mean(values):.{digits}f} ± " + (f"{se:.{digits}f}" if se is not None else "n/a")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("grid", help="a compare_precision.py --out folder")
    p.add_argument("--reference", help="run the paired differences are taken against")
    p.add_argument("--expected", choices=tuple(EXPECTED), default="-",
                   help="the claimed sign of run - reference (default -: lower; 0: parity) "
                        "the verdict reads")
    p.add_argument("--metric", nargs="*", default=[], help="metrics.jsonl keys to report")
    p.add_argument("--max-loss-after", type=int, default=10, metavar="N",
                   help="largest training loss over steps > N (default 10)")
    p.add_argument("--draws", metavar="NAME",
                   help="the runs NAME.d0, NAME.d1, ... are K random draws per seed "
                        "(compare_precision.py --random-draws): the reference's place among "
                        "them per seed and its permutation p, and the mean over the draws "
                        "- reference paired over the seeds")
    opts = p.parse_args(argv)
    runs = {}
    for path in sorted(Path(opts.grid, "runs").glob("*/seed_*/metrics.jsonl")):
        seed = int(path.parent.name.removeprefix("seed_"))
        runs.setdefault(path.parent.parent.name, {})[seed] = summarise(
            read(path), opts.metric, opts.max_loss_after)
    ref = runs.get(opts.reference, {})
    for name, seeds in runs.items():
        done = {s: v for s, v in seeds.items() if v["val"] is not None}
        losses = {s: v["val"][1] for s, v in done.items()}
        line = [f"{name}: seeds {sorted(seeds)} at steps {[v['step'] for v in seeds.values()]}"]
        if losses:
            steps = [v["val"][0] for v in done.values()]
            line.append(f"val {fmt(list(losses.values()))} (step {steps})")
        same = {s: ref[s]["val"][1] for s in losses
                if s in ref and ref[s]["val"] and ref[s]["val"][0] == done[s]["val"][0]}
        if same and name != opts.reference:
            d = paired(losses, same)
            line.append(f"vs {opts.reference} {describe(d)} "
                        f"[{', '.join(f'{v:+.4f}' for v in d.diffs.values())}]: "
                        f"{verdict(d, EXPECTED[opts.expected])}")
        peaks = [v["max_loss"] for v in seeds.values() if v["max_loss"] is not None]
        if peaks:
            line.append(f"max train loss {fmt(peaks, 3)}")
        for m in opts.metric:
            values = [v[m] for v in seeds.values() if v[m] is not None]
            if values:
                line.append(f"{m} {fmt(values)} [{', '.join(f'{v:.4g}' for v in values)}]")
        print("\n    ".join(line))
    if opts.draws:
        print(draws_line(runs, opts.draws, opts.reference))
    return 0


def _last_val(seeds: dict) -> dict[int, float]:
    return {s: v["val"][1] for s, v in seeds.items() if v["val"] is not None}


def draws_line(runs: dict, prefix: str, reference: str) -> str:
    """The reference's place among the draws ``prefix.d*`` per seed, its permutation p and
    the paired difference mean(draws) - reference (seeds every draw finished)."""
    draws = [_last_val(seeds) for name, seeds in runs.items()
             if name.startswith(prefix + ".d")]
    ref = _last_val(runs.get(reference, {}))
    seeds = [s for s in ref if draws and all(s in d for d in draws)]
    if not seeds:
        return f"{prefix} draws: no seed where the reference and every draw finished"
    per_seed = {s: [d[s] for d in draws] for s in seeds}
    place, p = place_among_draws({s: ref[s] for s in seeds}, per_seed)
    diff = paired({s: mean(per_seed[s]) for s in seeds}, ref)
    return (f"{prefix} ({len(draws)} draws per seed) vs {reference}: {reference}'s place "
            f"among the draws {place} (0: better than every draw), permutation p "
            f"{p:.3f}; mean of the draws - {reference} {describe(diff)}: "
            f"{verdict(diff, 1)}")


if __name__ == "__main__":
    sys.exit(main())
