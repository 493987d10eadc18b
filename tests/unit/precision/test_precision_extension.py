"""The precision extension in real (single-process) training runs: inert without flags, FLOP
fractions in the metrics, the plan checkpointed and restored, bad flags as one line; changed
sites reported on the next logged step."""

import json
from types import SimpleNamespace

import pytest

from megatron_ext.precision.extension import PrecisionRun
from megatron_ext.precision.plan import load_plan
from megatron_ext.precision.policies import uniform_plan
from megatron_ext.precision.site_formats import SiteFormats
from precision_helpers import FAST, REPO, launch_precision


def _records(run_dir):
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in _records(run_dir)}


def _train(tmp_path, name, *extra, steps=3, script=None):
    run_dir = tmp_path / name
    kw = {"script": script} if script else {}
    proc = launch_precision([*FAST, "--train-iters", steps, "--run-dir", run_dir, *extra], **kw)
    return run_dir, proc


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """The plain entry point's run: megatron's linears in FP32."""
    run_dir, _ = _train(tmp_path_factory.mktemp("fp32"), "fp32", "--no-save", steps=4,
                        script=REPO / "pretrain_llama.py")
    return _losses(run_dir)


@pytest.fixture(scope="module")
def fp4(tmp_path_factory):
    """An uninterrupted uniform:fp4 run: (run dir, stdout)."""
    run_dir, proc = _train(tmp_path_factory.mktemp("fp4"), "fp4", "--no-save", "--precision",
                           "uniform:fp4", steps=4)
    return run_dir, proc.stdout


def test_without_precision_flags_the_run_is_megatrons(tmp_path, fp32):
    ours, _ = _train(tmp_path, "ours", "--no-save", steps=4)
    assert _losses(ours) == fp32
    assert "fp4_flop_frac" not in _records(ours)[0]
    assert not (ours / "precision_plan.json").exists()


def test_uniform_fp4_trains_and_logs_its_flop_split(fp32, fp4):
    run_dir, stdout = fp4
    plan = uniform_plan("fp4", 4).replace(stage_fp4_frac=[1.0])
    assert (f"precision: plan uniform:fp4 ({plan.hash[:12]}) | linear FLOPs FP4 100.0% FP8 "
            "0.0% BF16 0.0%" in stdout)
    first = _records(run_dir)[0]
    assert (first["fp4_flop_frac"], first["fp8_flop_frac"], first["bf16_flop_frac"]) == (1, 0, 0)
    assert first["precision_plan"] == plan.hash[:12] and first["gemm_time_vs_bf16"] == 0.25
    assert load_plan(str(run_dir / "precision_plan.json")).hash == plan.hash  # the plan applied
    losses = _losses(run_dir)
    assert losses != fp32  # the GEMMs really were quantized ...
    for step, loss in losses.items():  # ... and training still works
        assert loss == pytest.approx(fp32[step], rel=0.05)


@pytest.mark.parametrize("fmt, fraction", [("mxfp4", "fp4_flop_frac"),
                                           ("fp8_e4m3@row", "fp8_flop_frac")])
def test_uniform_any_registered_format_trains(tmp_path, fp32, fmt, fraction):
    """``--precision uniform:<format>`` with a format that is no recipe (issue 21)."""
    run_dir, _ = _train(tmp_path, "run", "--no-save", "--precision", f"uniform:{fmt}", steps=4)
    assert _records(run_dir)[0][fraction] == 1.0
    plan = load_plan(str(run_dir / "precision_plan.json"))
    assert plan.method == f"uniform:{fmt}" and plan.formats("L2.fc1") == SiteFormats(fmt, fmt, fmt)
    losses = _losses(run_dir)
    assert losses != fp32  # quantized ...
    for step, loss in losses.items():  # ... and still training
        assert loss == pytest.approx(fp32[step], rel=0.05)


def test_plan_is_checkpointed_and_restored(tmp_path, fp4):
    # uniform:fp4 rounds dy stochastically: an identical continuation also needs the RNG
    ckpt = tmp_path / "ckpt"
    _train(tmp_path, "first", "--save", ckpt, "--precision", "uniform:fp4", "--exit-interval", 2,
           steps=4)
    resumed, proc = _train(tmp_path, "resumed", "--no-save", "--load", ckpt,
                           "--precision", "uniform:fp8", steps=4)
    assert "restoring the checkpoint's plan (uniform:fp4" in proc.stdout
    assert _losses(resumed) == {s: l for s, l in _losses(fp4[0]).items() if s > 2}
    assert _records(resumed)[0]["fp4_flop_frac"] == 1.0
    kept, _ = _train(tmp_path, "override", "--no-save", "--load", ckpt, "--lr-decay-iters", 4,
                     "--precision", "uniform:fp8", "--override-precision-plan", steps=3)
    assert _records(kept)[0]["fp8_flop_frac"] == 1.0


def test_bad_plan_flag_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "plan.json"
    plan = uniform_plan("fp8", 6)  # layers 4, 5: unknown
    bad.write_text(plan.to_json())
    proc = launch_precision([*FAST, "--train-iters", 2, "--run-dir", tmp_path / "r",
                             "--precision-plan", bad], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert errors == ["error: --precision-plan: unknown site L4.qkv: the model has layers 0-3"]
    assert not (tmp_path / "r").exists()


def test_plan_lines_are_rate_limited_with_the_count(monkeypatch, capsys):
    from megatron_ext.precision import extension

    monkeypatch.setattr(extension.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(extension, "_summary", lambda plan, report: f"precision: plan {plan}")
    run = extension.PrecisionRun()
    printed = {}
    for step in range(400):  # a change at 0, 3, 7, 60, 61, 200; a commit every step
        if step in (0, 3, 7, 60, 61, 200):
            run.controller.applied = f"p{step}"
            run.unprinted += 1
        run._print(step)
        if out := capsys.readouterr().out:
            printed[step] = out.strip()
    every = extension.PLAN_LINE_EVERY
    assert every == 50
    assert printed == {0: "precision: plan p0",
                       50: "precision: plan p7 | 2 plan changes since step 0",
                       100: "precision: plan p61 | 2 plan changes since step 50",
                       200: "precision: plan p200"}


def test_changed_sites_wait_for_the_next_logged_step():
    precision = PrecisionRun()
    precision.controller.applied = SimpleNamespace(hash="0123456789abcdef")
    precision.report = SimpleNamespace(metrics=lambda: {"precision_fp4_frac": 0.5})
    precision.changed = ["L0.fc2"]
    quiet = SimpleNamespace(step_result={"logged": False})
    logged = SimpleNamespace(step_result={"logged": True})
    assert precision.on_step(None, quiet, None) is None
    assert precision.on_step(None, logged, None) == {
        "precision_fp4_frac": 0.5, "precision_plan": "0123456789ab",
        "precision_changed_sites": ["L0.fc2"]}
    assert "precision_changed_sites" not in precision.on_step(None, logged, None)


@pytest.mark.parametrize("precision", [["uniform:fp8"], ["uniform:fp8_e4m3", "--fp8-execution",
                                                         "real"]], ids=["blockwise", "real"])
def test_weights_quantized_once_per_step_train_and_evaluate_the_same(tmp_path, precision):
    # FAST has 4 micro-batches a step; evaluation after every step: a cached weight of the
    # last step (or of the evaluation) would change the next step's loss. Real per tensor:
    # fprop's FP8 weight and dgrad's transpose of it, from one cast a step
    flags = ["--no-save", "--precision", *precision, "--eval-interval", "1",
             "--eval-iters", "1"]
    cached, proc = _train(tmp_path, "cached", *flags)
    plain, plain_proc = _train(tmp_path, "plain", *flags, "--no-cache-quantized-weights")
    assert "quantized weights made once per step for its 4 micro-batches" in proc.stdout
    assert "once per step" not in plain_proc.stdout
    records = [[{k: r[k] for k in ("step", "loss", "val_loss") if k in r}
                for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]
               for d in (cached, plain)]
    assert records[0] == records[1] and sum("val_loss" in r for r in records[0]) == 4


def test_device_profile_file_sets_the_printed_estimate(tmp_path):
    """uniform:fp4 with --device-profile FILE (H100's: FP4 emulated) prints and logs the GEMM
    time the cost model gives on that profile, >= 1x BF16 (nominal: 0.25x, above)."""
    from megatron_ext.precision.cost import ModelShape, flop_report
    from megatron_ext.precision.device_profile import PROFILES

    profile = tmp_path / "h100.json"
    profile.write_text(PROFILES["h100"].to_json())
    run_dir, proc = _train(tmp_path, "h100", "--no-save", "--precision", "uniform:fp4",
                           "--device-profile", profile, steps=2)
    args = SimpleNamespace(**json.loads((run_dir / "args.json").read_text()))
    expected = flop_report(uniform_plan("fp4", args.num_layers).formats,
                           ModelShape.from_args(args), profile=PROFILES["h100"]).time_vs_bf16
    assert expected >= 1.0
    assert f"est. GEMM time {expected:.2f}x BF16 (device h100)" in proc.stdout
    assert _records(run_dir)[0]["gemm_time_vs_bf16"] == pytest.approx(expected)
