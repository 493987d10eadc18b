"""tools/plot_precision.py: every plot is a whole, non-trivial PNG; bad input is refused.

Inputs are built in a temporary directory: plans with megatron_ext.precision's policies and
hand-made site formats, a run directory with three SNIP refreshes (plan.json and
divergence.json each), and two runs' synthetic metrics.jsonl.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from megatron_ext.precision.cost import ModelShape, flop_report
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.controller import compose
from megatron_ext.precision.policies import UNIFORM, keep_overlay, uniform_plan
from megatron_ext.sites import SITES, site_id
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.defaults import plot_main as main
from megatron_ext.viz.colors import CLASS_COLORS, family_color, format_family
from megatron_ext.viz.inputs import default_option, fp4_roles

REPO = Path(__file__).resolve().parents[3]
LAYERS = 4
MIXED = [UNIFORM["fp8"], UNIFORM["fp4"], SiteFormats("mxfp4", "nvfp4", "mxfp8"),
         SiteFormats("bf16", "bf16", "none", overrides=(("wgrad.x", "fp8_e4m3"),))]
OPTIONS = ["x=fp8_e4m3@tile128,w=fp8_e4m3@block128,dy=fp8_e4m3@tile128",
           "x=fp4_e2m1@tile128,w=fp4_e2m1@block128,dy=fp4_e2m1@tile128+sr",
           "x=fp4_e2m1@tile128,w=fp4_e2m1@block128,dy=fp8_e4m3@tile128"]


def _mixed_plan(step: int = 0) -> PrecisionPlan:
    sites = {site_id(layer, s): MIXED[(layer + i + step) % len(MIXED)]
             for layer in range(LAYERS) for i, s in enumerate(SITES)}
    return PrecisionPlan(sites, method="snip", step=step)


def _divergence(step: int) -> dict:
    rng = np.random.default_rng(step)
    sites = {site_id(layer, s): {o: {"dL": float(10 ** (-6 + j + rng.random())),
                                     "dW": float(10 ** (-7 + j + rng.random())),
                                     "q": float(rng.random() - 0.2)}
                                 for j, o in enumerate(OPTIONS)}
             for layer in range(LAYERS) for s in SITES}
    return {"version": 1, "step": step, "options": OPTIONS, "sites": sites}


def _write_metrics(run: Path, offset: float) -> None:
    run.mkdir()
    lines = [{"step": 0, "val_loss": 8.3, "val_ppl": 4000.0}]
    for step in range(1, 201):
        lines.append({"step": step, "loss": 5 + 3 * math.exp(-step / 50) + offset, "lr": 1e-3})
        if step % 50 == 0:
            lines.append({"step": step, "val_loss": 5.1 + 3 * math.exp(-step / 50) + offset})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plot_inputs")
    (root / "mixed.json").write_text(_mixed_plan().to_json())
    kept = keep_overlay(1, LAYERS)
    (root / "fp4.json").write_text(compose(uniform_plan("fp4", LAYERS), [kept]).to_json())
    for step in (100, 200, 300):
        refresh = root / "run" / "snip" / f"step_{step:06d}"
        refresh.mkdir(parents=True)
        (refresh / "plan.json").write_text(_mixed_plan(step // 100).replace(step=step).to_json())
        (refresh / "divergence.json").write_text(json.dumps(_divergence(step)))
    _write_metrics(root / "fp8", 0.0)
    _write_metrics(root / "snip", 0.15)
    return root


def plot(*argv) -> int:
    return main([str(a) for a in argv])


def colour_share(png: Path, colour: str) -> float:
    """Fraction of the image's pixels that have exactly ``colour``."""
    image = imread(png)[..., :3]
    target = np.round(np.array(to_rgb(colour)) * 255)
    return float((np.round(image * 255) == target).all(axis=-1).mean())


def check_png(png: Path, colours=(), min_distinct: int = 4, min_share: float = 0.005):
    """A decodable PNG of a reasonable size with ``colours`` (each on ``min_share`` of the
    pixels) and at least ``min_distinct`` colours that cover >= 0.5 % each."""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < png.stat().st_size < 500_000
    image = imread(png)[..., :3]
    assert image.shape[0] >= 250 and image.shape[1] >= 350
    _, counts = np.unique(np.round(image * 255).reshape(-1, 3), axis=0, return_counts=True)
    assert (counts >= 0.005 * counts.sum()).sum() >= min_distinct
    for colour in colours:
        assert colour_share(png, colour) >= min_share, colour
    assert not [p for p in os.listdir(png.parent) if p.endswith(".tmp")]  # no leftovers


def test_plan_heatmap_shows_each_format_family(inputs, tmp_path, capsys):
    out = tmp_path / "plan.png"
    assert plot("plan", inputs / "mixed.json", "--out", out) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    families = {"fp8", "fp4", "mxfp4", "nvfp4", "mxfp8", "bf16", "none"}
    check_png(out, [family_color(f) for f in families], min_distinct=len(families))


def test_stage_bars_are_the_cost_models_fractions(inputs, tmp_path, capsys):
    out = tmp_path / "stages.png"
    assert plot("stages", inputs / "fp4.json", "--pipeline-model-parallel-size", "2",
                "--out", out) == 0
    plan = PrecisionPlan.from_json((inputs / "fp4.json").read_text())
    shape = ModelShape(LAYERS, 128, 352, 4, 2, True, 1, 2)  # the llama 'tiny' preset
    report = flop_report(plan.formats, shape)
    printed = capsys.readouterr().out.splitlines()
    for stage, fractions in enumerate(report.stage_fractions):
        assert printed[stage] == (f"stage {stage}: FP4 {100 * fractions['fp4']:.1f}%, "
                                  f"FP8 {100 * fractions['fp8']:.1f}%, "
                                  f"BF16 {100 * fractions['bf16']:.1f}%")
    assert report.stage_fractions[0]["bf16"] == 0.5  # layer 0 of 0-1 kept in BF16
    check_png(out, [CLASS_COLORS["fp4"], CLASS_COLORS["bf16"]])


@pytest.mark.parametrize("color_by", ["fp4-roles", "format"])
def test_evolution_of_a_run_directory(inputs, tmp_path, color_by):
    out = tmp_path / "evolution.png"
    assert plot("evolution", inputs / "run", "--color-by", color_by, "--out", out) == 0
    colours = (["#8b1a1a", "#e3e3e3"] if color_by == "fp4-roles" else
               [family_color("fp4"), family_color("fp8"), family_color("mxfp4")])
    check_png(out, colours)


def test_evolution_of_plan_files_is_in_step_order(inputs, tmp_path):
    plans = sorted((inputs / "run").glob("snip/step_*/plan.json"), reverse=True)
    out = tmp_path / "evolution.png"
    assert plot("evolution", *plans, "--out", out) == 0
    check_png(out)
    same = tmp_path / "same.png"
    assert plot("evolution", *reversed(plans), "--out", same) == 0
    assert same.read_bytes() == out.read_bytes()


@pytest.mark.parametrize("metric", ["dL", "dW", "q"])
def test_divergence_heatmap(inputs, tmp_path, metric):
    out = tmp_path / "divergence.png"
    source = inputs / "run" / "snip" / "step_000100" / "divergence.json"
    assert plot("divergence", source, "--metric", metric, "--out", out) == 0
    check_png(out, min_distinct=6)  # a colour scale over 16 cells


def test_divergence_default_option_is_the_all_fp4_one(inputs, tmp_path):
    assert default_option(OPTIONS) == OPTIONS[1]
    assert [fp4_roles(o) for o in OPTIONS] == [0, 3, 2]
    assert default_option(["fp8", "bf16"]) == "fp8"  # no FP4 anywhere: the first
    assert fp4_roles("x=int4@tile128,w=mxfp4,dy=nvfp4+sr") == 3  # the cost model's FP4 class
    source = inputs / "run" / "snip" / "step_000100" / "divergence.json"
    chosen, default = tmp_path / "chosen.png", tmp_path / "default.png"
    assert plot("divergence", source, "--out", default) == 0
    assert plot("divergence", source, "--option", OPTIONS[1], "--out", chosen) == 0
    assert chosen.read_bytes() == default.read_bytes()
    assert plot("divergence", source, "--option", OPTIONS[0], "--out", chosen) == 0
    assert chosen.read_bytes() != default.read_bytes()


def test_loss_curves_of_two_runs(inputs, tmp_path):
    out = tmp_path / "loss.png"
    assert plot("loss", inputs / "fp8", inputs / "snip" / "metrics.jsonl", "--labels",
                "fp8,snip", "--smooth", "5", "--out", out) == 0
    check_png(out, ["C0", "C1"], min_distinct=1, min_share=0.001)  # thin lines


def test_loss_curves_from_a_step_keep_the_records_before_it(inputs, tmp_path):
    from megatron_ext.viz.inputs import load_loss_curve
    from megatron_ext.viz.plots import loss_curves

    curve = load_loss_curve(str(inputs / "fp8"), "fp8")
    train, val = loss_curves([curve], smooth=5, from_step=150).axes[0].get_lines()
    assert list(train.get_xdata()) == list(range(150, 201)) and list(val.get_xdata()) == [150, 200]
    losses = dict(curve.train)
    fit = np.polyfit(range(148, 153), [losses[s] for s in range(148, 153)], 2)  # 2 each side
    assert train.get_ydata()[0] == pytest.approx(np.polyval(fit, 150))
    assert train.get_ydata()[-1] == pytest.approx(losses[200])  # the last: no neighbours after
    out = tmp_path / "end.png"
    assert plot("loss", inputs / "fp8", "--from-step", "150", "--out", out) == 0
    check_png(out, ["C0"], min_distinct=1, min_share=0.001)


def test_format_families_and_colours_are_stable():
    assert format_family("fp8_e4m3@tile128+sr") == format_family("fp8_e5m2") == "fp8"
    assert format_family("mxfp8_e5m2+sr") == "mxfp8"
    assert format_family("fp4_e2m1@block128") == "fp4" and format_family("nvfp4+sr") == "nvfp4"
    assert format_family("none") == "none" and format_family("BF16") == "bf16"
    assert family_color("fp6") != family_color("fp4")
    assert family_color("mystery") == family_color("mystery") != family_color("other")


def test_help_runs_as_a_script():
    tool = REPO / "tools" / "plot_precision.py"
    done = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0
    assert all(cmd in done.stdout for cmd in ("plan", "stages", "evolution", "divergence",
                                              "loss", "gnmr"))


def _edit_json(path: Path, **changes) -> Path:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return path


def _copy(inputs: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / Path(name).name
    target.write_text((inputs / name).read_text())
    return target


BAD = {
    "missing plan": (lambda i, t: ["plan", t / "nope.json"], "cannot read"),
    "plan not JSON": (lambda i, t: ["plan", _write(t / "p.json", "{\n,")],
                      "is not valid JSON: Expecting property name enclosed in double quotes "
                      "at line 2"),
    "plan with an unknown site": (lambda i, t: ["plan", _edit_json(
        _copy(i, t, "mixed.json"), sites={"L0.attn": {"x": "bf16", "w": "bf16", "dy": "bf16"}})],
        "bad site id 'L0.attn'"),
    "too few layers": (lambda i, t: ["plan", i / "mixed.json", "--num-layers", "2"],
                       "the plan has layers 0-3; --num-layers 2 is too few"),
    "pp does not divide": (lambda i, t: ["stages", i / "mixed.json",
                                         "--pipeline-model-parallel-size", "3"],
                           "--pipeline-model-parallel-size 3 does not divide the 4 layers"),
    "unknown preset": (lambda i, t: ["stages", i / "mixed.json", "--model", "huge",
                                     "--pipeline-model-parallel-size", "1"],
                       "unknown model preset 'huge'"),
    "run without refreshes": (lambda i, t: ["evolution", i / "fp8"],
                              "has no snip/step_*/plan.json"),
    "same step twice": (lambda i, t: ["evolution", i / "run",
                                      i / "run" / "snip" / "step_000100" / "plan.json"],
                        "two plans for step 100"),
    "divergence not version 1": (lambda i, t: ["divergence", _edit_json(
        _copy(i, t, "run/snip/step_000100/divergence.json"), version=2)],
        "is not a version-1 divergence file"),
    "divergence value not a number": (lambda i, t: ["divergence", _edit_json(
        _copy(i, t, "run/snip/step_000100/divergence.json"),
        sites={"L0.qkv": {OPTIONS[0]: {"dL": "big"}}})], "['x=fp8_e4m3@tile128"),
    "unknown option": (lambda i, t: ["divergence",
                                     i / "run" / "snip" / "step_000100" / "divergence.json",
                                     "--option", "fp2"], "--option 'fp2' is not in"),
    "no positive values": (lambda i, t: ["divergence", _write(t / "d.json", json.dumps(
        {"version": 1, "step": 1, "options": ["a"], "sites": {"L0.qkv": {"a": {"dL": 0}}}}))],
        "no positive dL value for option 'a'"),
    "labels do not match runs": (lambda i, t: ["loss", i / "fp8", "--labels", "a,b"],
                                 "--labels has 2 label(s) for 1 run(s)"),
    "metrics line not JSON": (lambda i, t: ["loss", _write(t / "m.jsonl",
                                                           '{"step": 1, "loss": 2}\nnot json\n')],
                              "line 2 is not valid JSON"),
    "no loss records": (lambda i, t: ["loss", _write(t / "m.jsonl", '{"step": 1}\n')],
                        "has no \"loss\" or \"val_loss\" records"),
    "missing run": (lambda i, t: ["loss", t / "nowhere"], "cannot read"),
    "from-step past the runs": (lambda i, t: ["loss", i / "fp8", "--from-step", "201"],
                                "--from-step 201: no records at or after it"),
    "unknown command": (lambda i, t: ["pie"], "invalid choice: 'pie'"),
    "output directory missing": (lambda i, t: ["plan", i / "mixed.json", "--out",
                                               t / "no" / "dir.png"], "cannot write"),
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_no_file(case, inputs, tmp_path, capsys):
    make_argv, message = BAD[case]
    argv = make_argv(inputs, tmp_path)
    out = tmp_path / "out.png"
    if "--out" not in argv and argv[0] != "pie":
        argv += ["--out", out]
    capsys.readouterr()
    assert plot(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob(".*.tmp"))


def test_smoothing_does_not_lag_a_falling_loss():
    from megatron_ext.viz.inputs import LossCurve
    from megatron_ext.viz.plots import loss_curves

    steps = range(10, 4001, 10)  # logged every 10 steps; the loss falls linearly, with noise
    rng = np.random.default_rng(0)
    loss = {s: 8.0 - s / 1000 + rng.normal(0, 0.05) for s in steps}
    curve = LossCurve("run", tuple(sorted(loss.items())), ())
    (train,) = loss_curves([curve], smooth=20).axes[0].get_lines()
    smoothed = dict(zip(train.get_xdata(), train.get_ydata()))
    bias = np.mean([smoothed[s] - (8.0 - s / 1000) for s in steps])
    assert abs(bias) < 0.01  # a trailing mean of 20 records would sit 0.095 above (95 steps)
    assert np.std([smoothed[s] - (8.0 - s / 1000) for s in steps[20:-20]]) < 0.025
    bend = {s: 3 + 5 * np.exp(-s / 80) for s in range(10, 401, 10)}  # a default run's start
    (train,) = loss_curves([LossCurve("bend", tuple(bend.items()), ())],
                           smooth=20).axes[0].get_lines()
    assert np.allclose(train.get_ydata(), list(bend.values()), atol=0.1)  # a mean: +0.4
def test_subcommands_are_assembled_from_the_extensions(tmp_path, capsys):
    """Issue 24, item 2: a method's plot is a subcommand when its extension brings it, and
    not otherwise (the tool hard-codes none of them)."""
    from matplotlib.figure import Figure

    from megatron_ext.extension import Plot
    from megatron_ext.viz.cli import main

    seen = []

    def draw(args):
        seen.append(args.value)
        return Figure(figsize=(1, 1))

    toy = Plot("toy", "a toy figure", lambda p: p.add_argument("value"), draw)
    out = tmp_path / "toy.png"
    assert main(["toy", "7", "--out", str(out)], plots=[toy]) == 0
    assert seen == ["7"] and out.stat().st_size > 0
    assert main(["gnmr", "run", "--out", str(tmp_path / "g.png")], plots=[toy]) == 2
    assert "invalid choice: 'gnmr'" in capsys.readouterr().err


def test_the_tool_offers_exactly_the_plots_the_extensions_bring(tmp_path, capsys):
    """The methods' plots come from their Extensions; a method without plots (the toy of
    tests/e2e/toy_method) has no subcommand: one line, exit status 2, no traceback."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    from toy_method import toy_extension

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("evolution", "divergence", "gnmr", "pgq", "stquant",
                                        "gaussws"))
    assert main(["toy", str(tmp_path), "--out", str(tmp_path / "t.png")], toy_extension) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'toy'" in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
