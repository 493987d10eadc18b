"""``--gnmr`` through the real entry point: promotions land in the plan at the next step
boundary, the norms are the unclipped gradients' (recomputed by a probe), a non-finite step
promotes, resume between a promotion and its demotion is bit for bit, and SNIP refreshes
replace the base under the promotions."""

import json
from pathlib import Path

import pytest

from pretrain_runner import FAST_ARGS, launch, read_metrics
from megatron_ext.sites import SITES

PROBE = Path(__file__).with_name("gnmr_probe.py")
LOW = ["--gnmr", "--gnmr-alpha-init", "1.01", "--gnmr-alpha", "1.01", "--gnmr-beta-init",
       "1.01", "--gnmr-beta", "1.01", "--gnmr-lock", "2", "--gnmr-max-promoted", "2"]
FP4_X, FP8 = "fp4_e2m1@tile128", {"x": "fp8_e4m3@tile128", "w": "fp8_e4m3@block128",
                                  "dy": "fp8_e4m3@tile128"}


def _strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(line, parse_constant=refuse)


def read_trace(run_dir) -> list[dict]:
    return [_strict(line) for line in (Path(run_dir) / "gnmr" / "trace.jsonl").open()]


def _steps(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def _high(line) -> set[str]:
    return {u for u, v in line["units"].items() if v["high"]}


def _sites(units) -> list[str]:
    return sorted(f"{u}.{s}" for u in units for s in SITES)


@pytest.fixture(scope="module")
def fp4_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gnmr") / "run"
    launch([*FAST_ARGS, "--run-dir", str(run_dir), "--no-save", "--train-iters", "7",
            "--precision", "uniform:fp4", *LOW, "--inject-nonfinite-at-step", "5"],
           script=PROBE)
    return run_dir


def test_trace_and_metrics(fp4_run):
    trace, steps = read_trace(fp4_run), _steps(fp4_run)
    assert [line["step"] for line in trace] == list(range(1, 8))
    assert all(list(line["units"]) == ["L0", "L1", "L2", "L3"] for line in trace)
    previous = set()
    for line in trace:
        high, record = _high(line), steps[line["step"]]
        assert len(high) <= 2 and record["gnmr_units_high"] == len(high)
        assert record["gnmr_promotions"] == len(high - previous)
        assert record["gnmr_demotions"] == len(previous - high)
        if line["step"] < 7:  # the plan in force changes at the next step boundary
            changed = steps[line["step"] + 1].get("precision_changed_sites", [])
            assert changed == _sites(high ^ previous)
        previous = high
    assert sum(steps[t]["gnmr_promotions"] for t in steps) >= 2
    assert any(steps[t]["gnmr_budget_dropped"] > 0 for t in steps)


def test_nonfinite_step_promotes_the_deepest_units(fp4_run):
    line, record = read_trace(fp4_run)[4], _steps(fp4_run)[5]
    assert line["nonfinite"] is True and record["skipped"] is True
    assert all(u["norm"] is None for u in line["units"].values())
    assert record["gnmr_nonfinite_units"] == 4
    assert _high(line) == {"L2", "L3"}  # every norm NaN: the budget keeps the deepest two
    assert line["units"]["L3"]["lock"] == 2


def test_promoted_blocks_run_in_fp8_in_the_plan(fp4_run):
    plan = json.loads((fp4_run / "precision_plan.json").read_text())
    high = _high(read_trace(fp4_run)[-2])  # the decision after step 6 set step 7's plan
    assert high and plan["method"] == "uniform:fp4+promotions"
    for sid, formats in plan["sites"].items():
        if sid.split(".")[0] in high:
            assert {r: formats[r] for r in ("x", "w", "dy")} == FP8, sid
        else:
            assert formats["x"] == FP4_X, sid


def test_norms_are_the_unclipped_gradients(fp4_run):
    probes = [json.loads(line) for line in (fp4_run / "probe_norms.jsonl").open()]
    observed = [line for line in read_trace(fp4_run) if not line.get("nonfinite")]
    assert len(probes) == len(observed) == 6
    clipped = 0
    for probe, line in zip(probes, observed):
        norms = [line["units"][f"L{i}"]["norm"] for i in range(4)]
        assert norms == pytest.approx(probe["before"], rel=1e-12)
        clipped += probe["after"] != pytest.approx(probe["before"], rel=1e-3)
    assert clipped >= 3  # clipping (--clip-grad 1) changed the buffers: the order matters


# step 1 alone uses the -init thresholds (round(0.125 * 8) = 1): GNMR = 1 > 0.5 promotes every
# unit, the budget keeps the deepest two (equal risk), and nothing triggers after (1000)
SCRIPTED = ["--gnmr", "--gnmr-warmup-frac", "0.125", "--gnmr-alpha-init", "0.5",
            "--gnmr-beta-init", "0.5", "--gnmr-alpha", "1000", "--gnmr-beta", "1000",
            "--gnmr-max-promoted", "2"]


def _scripted(**changes) -> list[str]:
    """SCRIPTED with some values changed (each flag is given once: a repeat is refused)."""
    flags = list(SCRIPTED)
    for name, value in changes.items():
        flags[flags.index("--gnmr-" + name.replace("_", "-")) + 1] = str(value)
    return flags


def test_resume_between_promotion_and_demotion_is_exact(tmp_path):
    flags = [*FAST_ARGS, "--precision", "uniform:fp4", *SCRIPTED, "--gnmr-lock", "4",
             "--train-iters", "8"]
    full, second, ckpt = (tmp_path / n for n in ("full", "second", "ckpt"))
    # the uninterrupted run saves at step 3 on its way; the resume starts from that save
    launch([*flags, "--run-dir", str(full), "--save", str(ckpt), "--save-interval", "3"])
    launch([*flags, "--run-dir", str(second), "--load", str(ckpt / "iter_0000003"),
            "--no-save"])
    trace = read_trace(full)
    # promoted after step 1, high for steps 2-5 (lines: the plan of the next step), demoted
    # after step 5: the save at 3 falls inside the lock
    assert ([sorted(_high(line)) for line in trace] ==
            [["L2", "L3"]] * 4 + [[]] * 4 and trace[2]["units"]["L3"]["lock"] == 2)
    assert read_trace(second) == trace[3:]
    resumed, straight = _steps(second), _steps(full)
    assert sorted(resumed) == [4, 5, 6, 7, 8]
    assert [resumed[t]["loss"] for t in resumed] == [straight[t]["loss"] for t in resumed]
    assert [resumed[t]["grad_norm"] for t in resumed] == [straight[t]["grad_norm"]
                                                         for t in resumed]
    assert resumed[6]["precision_changed_sites"] == _sites(["L2", "L3"])  # the demotion
    # resumed without --gnmr: nothing would demote the promotions, so they are dropped
    plain = tmp_path / "plain"
    proc = launch([*FAST_ARGS, "--precision", "uniform:fp4", "--train-iters", "4",
                   "--use-checkpoint-opt_param-scheduler", "--run-dir", str(plain),
                   "--load", str(ckpt / "iter_0000003"), "--no-save"])
    assert "dropping the checkpoint's GNMR promotions of 8 site(s)" in proc.stdout
    plan = json.loads((plain / "precision_plan.json").read_text())
    assert all(f["x"] == FP4_X for f in plan["sites"].values()) and not (plain / "gnmr").exists()


def test_snip_refresh_replaces_the_base_and_promotions_survive(tmp_path):
    run_dir = tmp_path / "snip"
    launch([*FAST_ARGS, "--run-dir", str(run_dir), "--no-save", "--train-iters", "6",
            "--precision", "snip", "--snip-budget", "0.9", "--snip-start", "2",
            "--snip-interval", "2", "--snip-apply-lag", "1",
            *_scripted(warmup_frac=0.1, max_promoted=1), "--gnmr-lock", "100"])
    assert all(sorted(_high(line)) == ["L3"] for line in read_trace(run_dir))
    snip = json.loads((run_dir / "snip" / "step_000004" / "plan.json").read_text())["sites"]
    final = json.loads((run_dir / "precision_plan.json").read_text())
    assert final["method"].endswith("+promotions")

    def lifted(fmt, role):  # --gnmr-high auto by hand: FP4 -> the FP8 recipe, FP8 -> BF16
        return FP8[role] if fmt.startswith("fp4") else "bf16" if fmt.startswith("fp8") else fmt

    fp4_under_promotion = 0
    for sid, base in snip.items():
        got = {r: final["sites"][sid][r] for r in ("x", "w", "dy")}
        if sid.startswith("L3."):
            assert got == {r: lifted(base[r], r) for r in got}, sid
            fp4_under_promotion += sum(base[r].startswith("fp4") for r in got)
        else:
            assert got == {r: base[r] for r in got}, sid
    # the safe plan before the first refresh was all FP8 (promoted: BF16); SNIP's FP4 operands
    # of L3 now run FP8, so the overlay was recomputed from the new base, not kept stale
    assert fp4_under_promotion > 0
