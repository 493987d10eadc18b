"""benchmarks/gnmr_threshold_replay.py and benchmarks/claims_keep.py on hand-made files: the
exceedance counts at several thresholds (worked out by hand) and the per-seed evidence kept
from a grid's job folders (an unfinished job left out)."""

import csv
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import claims_keep  # noqa: E402
import gnmr_threshold_replay as replay  # noqa: E402


def _trace(path: Path) -> Path:
    steps = [  # (gnmr, dgnmr) of units A, B per step; step 2 written twice (a resume)
        (1, {"A": (1.0, 1.0), "B": (1.0, 1.0)}),
        (2, {"A": (9.0, 9.0), "B": (9.0, 9.0)}),
        (2, {"A": (2.5, 1.2), "B": (1.0, 1.6)}),
        (3, {"A": (3.5, 2.2), "B": (None, 1.0)}),
    ]
    lines = [json.dumps({"step": s, "units": {u: {"gnmr": g, "dgnmr": d}
                                              for u, (g, d) in units.items()}})
             for s, units in steps]
    path.write_text("\n".join(lines) + "\n{torn")
    return path


def test_replay_counts_unit_steps_over_the_thresholds(tmp_path):
    steps = replay.read_trace(_trace(tmp_path / "trace.jsonl"))
    assert len(steps) == 3 and steps[1]["A"]["gnmr"] == 2.5  # the last line of step 2
    # GNMR > 2: A at steps 2, 3 and B's non-finite (None) at step 3 -> 3 of 6
    # Δ-GNMR - 1 > 0.5: B at step 2 (0.6), A at step 3 (1.2) -> 2 of 6
    out = replay.exceedance(steps, 2.0, 0.5, excess=True)
    assert (out["over_alpha"], out["over_beta"], out["unit_steps"]) == (3, 2, 6)
    assert out["gnmr_pct"] == pytest.approx(50.0)
    ratio = replay.exceedance(steps, 3.0, 1.5, excess=False)  # Δ-GNMR > 1.5: B 1.6, A 2.2
    assert (ratio["over_alpha"], ratio["over_beta"]) == (2, 2)


def _job(grid: Path, run: str, seed: int, last_val_step: int) -> None:
    job = grid / "runs" / run / f"seed_{seed}"
    job.mkdir(parents=True)
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "m": 0.5},
               {"step": last_val_step, "val_loss": 4.5 + seed % 10 / 10}]
    (job / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    (job / "args.json").write_text(json.dumps({"train_iters": 2}))
    (job / "compare_job.json").write_text(json.dumps({"argv": ["x.py", "--seed", str(seed)]}))


def test_keep_writes_the_finished_jobs(tmp_path):
    grid, out, config = tmp_path / "grid", tmp_path / "out", tmp_path / "c.yaml"
    config.write_text("seeds: [1, 2]\n")
    _job(grid, "a", 1, 2)
    _job(grid, "a", 2, 2)
    _job(grid, "b", 1, 2)
    _job(grid, "b", 2, 1)  # validated only before its last step: not finished
    assert claims_keep.main([str(grid), str(out), "--config", str(config), "--metric", "m",
                             "--commit", "abc"]) == 0
    rows = list(csv.reader((out / "seeds.csv").open()))
    assert rows == [["seed", "a", "b", "a:m", "b:m"], ["1", "4.6", "4.6", "0.5", "0.5"],
                    ["2", "4.7", "", "0.5", ""]]
    runs = json.loads((out / "runs.json").read_text())
    assert runs["a"]["2"]["final_train_loss"] == 4.0 and runs["b"].keys() == {"1"}
    source = json.loads((out / "source.json").read_text())
    assert source["commit"] == "abc" and source["config"] == "seeds: [1, 2]\n"
