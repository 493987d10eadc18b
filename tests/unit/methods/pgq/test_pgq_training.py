"""``--precision pgq`` through the real entry point on the tiny Llama: the profile and recipe
files, the recipe's plan in force from the first step, training untouched by the profile (a run
with the same recipe from the saved profile, not profiling, has the identical losses), a
resume that keeps the recipe without profiling again, and bad flags."""

import json

import pytest

from megatron_ext.methods.pgq.profile import load_profile
from megatron_ext.methods.pgq.recipe import RecipeConfig, make_recipe
from megatron_ext.precision.plan import load_plan
from pretrain_runner import FAST_ARGS, launch, read_metrics, train_losses

PGQ = ["--precision", "pgq", "--pgq-device", "none", "--pgq-candidates", "int8,fp8",
       "--pgq-bwd-threshold", "5000"]  # some backward GEMMs fall below it at init
CONFIG = RecipeConfig(format="int8", bwd_threshold=5000, device="none")


@pytest.fixture(scope="module")
def pgq_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pgq") / "run"
    launch([*FAST_ARGS, *PGQ, "--pgq-profile-steps", "2", "--train-iters", "2", "--no-save",
            "--run-dir", str(run_dir)])
    return run_dir


def test_profile_covers_every_gemm_operand(pgq_run):
    profile = load_profile(str(pgq_run / "pgq" / "profile.json"))
    assert profile.steps == 2 and len(profile.losses) == 2 and profile.step == 0
    assert len(profile.gemms) == 2 + 4 * 4 * 3 + 3  # embedding, 16 sites, logits
    ratios = {(g.name, role): op.sqnr for g in profile.gemms for role, op in g.operands.items()}
    assert len(ratios) == 2 + 2 * (4 * 4 * 3 + 3)
    assert all(1 < r < float("inf") for sqnr in ratios.values() for r in sqnr.values())
    # the paper's finding: the logits' activation gradient is the hardest operand (int8)
    worst = min(ratios, key=lambda k: ratios[k]["int8"])
    assert worst == ("logits.dgrad", "dy")


def test_recipe_plan_is_in_force_from_the_first_step(pgq_run):
    profile = load_profile(str(pgq_run / "pgq" / "profile.json"))
    recipe = make_recipe(profile, CONFIG)
    quantized = sum(d.quantized for d in recipe.decisions)
    assert 0 < quantized < 48  # the thresholds split the GEMMs
    applied = load_plan(str(pgq_run / "precision_plan.json"))
    assert applied.sites == recipe.plan.sites and applied.method == "pgq"
    written = json.loads((pgq_run / "pgq" / "recipe.json").read_text())
    assert written["plan_hash"] == recipe.plan.hash and len(written["gemms"]) == 53
    assert "| logits.dgrad | bac |" in (pgq_run / "pgq" / "recipe.md").read_text()
    records = [r for r in read_metrics(pgq_run) if "loss" in r]
    assert records[0]["pgq_profile_s"] > 0 and "pgq_profile_s" not in records[1]
    assert 0 < records[0]["pgq_profile_last_batch_s"] < records[0]["pgq_profile_s"]
    assert records[0]["fp8_flop_frac"] == pytest.approx(recipe.fraction)


def test_saved_profile_gives_the_same_run_without_profiling(pgq_run, tmp_path):
    run_dir = tmp_path / "saved"
    launch([*FAST_ARGS, *PGQ, "--pgq-profile", str(pgq_run / "pgq" / "profile.json"),
            "--train-iters", "2", "--no-save", "--run-dir", str(run_dir)])
    assert not (run_dir / "pgq" / "profile.json").exists()
    assert (run_dir / "pgq" / "recipe.json").exists()
    assert (load_plan(str(run_dir / "precision_plan.json")).sites ==
            load_plan(str(pgq_run / "precision_plan.json")).sites)
    assert train_losses(run_dir) == train_losses(pgq_run)  # the profile did not perturb


def test_resume_keeps_the_recipe_and_does_not_profile_again(pgq_run, tmp_path):
    args = [*FAST_ARGS, *PGQ, "--pgq-profile-steps", "2", "--train-iters", "2"]
    ckpt = str(tmp_path / "ckpt")
    launch([*args, "--save", ckpt, "--exit-interval", "1", "--run-dir", str(tmp_path / "a")])
    launch([*args, "--load", ckpt, "--no-save", "--run-dir", str(tmp_path / "b")])
    assert not (tmp_path / "b" / "pgq").exists()
    assert train_losses(tmp_path / "b") == {2: train_losses(pgq_run)[2]}


def _validate(flags: list[str]) -> None:
    """Parse and validate the full entry point's flags in-process (no model is built)."""
    from megatron_ext.defaults import default_extensions
    from megatron_ext.extension import args_provider, hooks
    from megatron_ext.training.arguments import parse_args

    extensions = default_extensions()
    base = [a for flag, value in zip(PGQ[::2], PGQ[1::2]) if flag not in flags
            for a in (flag, value)]  # each flag given once: a repeated one is refused
    args = parse_args("llama", [*FAST_ARGS, *base, *flags, "--train-iters", "2"],
                      args_provider(extensions), world_size=1)
    for validate in hooks(extensions, "validate"):
        validate(args)


@pytest.mark.parametrize("flags, message", [
    (["--pgq-profile-steps", "0"], "--pgq-profile-steps must be >= 1"),
    (["--pgq-budget", "1.5"], "--pgq-budget must be in [0, 1]"),
    (["--pgq-candidates", "int8,nope"], "--pgq-candidates: unknown ['nope']"),
    (["--pgq-format", "nvfp4"], "--pgq-format 'nvfp4' is not among --pgq-candidates"),
    (["--pgq-bwd-threshold", "-1"], "--pgq-bwd-threshold must be a positive SQNR ratio"),
    (["--pgq-adversarial", "--pgq-random"], "exclude each other"),
    (["--pgq-profile-start", "2"], "--pgq-profile-start must be in [0, --train-iters)"),
])
def test_bad_pgq_flags_are_usage_errors(flags, message):
    from megatron_ext.errors import UsageError

    with pytest.raises(UsageError) as error:
        _validate(flags)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_pgq_flag_through_the_entry_point_is_one_line():
    proc = launch([*FAST_ARGS, *PGQ, "--pgq-profile", "missing.json", "--train-iters", "2",
                   "--no-save"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --precision: cannot read 'missing.json': No such "
                                   "file or directory")


# every forward GEMM quantized (fprop margins >> 1e-9), no backward one (<< 1e9): with
# --pgq-logits the output layer's fprop joins them, without it only the linear sites'
LATE = ["--precision", "pgq", "--pgq-device", "none", "--pgq-candidates", "fp4-tensor",
        "--pgq-format", "fp4-tensor", "--pgq-fwd-threshold", "1e-9", "--pgq-bwd-threshold",
        "1e9", "--pgq-profile-start", "1", "--pgq-profile-steps", "1"]


def test_late_profile_and_quantized_logits(tmp_path):
    """Step 1 runs the safe plan (the plain run's loss), the profile is taken before step 2,
    and the quantized output layer changes step 2's loss against the same linear plan
    without it; a resume after step 2 keeps the logits formats (step 3 bit for bit)."""
    base = [*FAST_ARGS, *LATE, "--train-iters", "3", "--no-save"]
    plain, linear, logits = (tmp_path / n for n in ("plain", "linear", "logits"))
    launch([*FAST_ARGS, "--train-iters", "3", "--no-save", "--run-dir", str(plain)])
    launch([*base, "--run-dir", str(linear)])
    launch([*base, "--pgq-logits", "--run-dir", str(logits)])
    assert load_profile(str(logits / "pgq" / "profile.json")).step == 1
    written = json.loads((logits / "pgq" / "recipe.json").read_text())
    assert written["logits"] == {"x": "none", "w": "none", "dy": "none", "overrides": {
        "fprop.x": "fp4_e2m1", "fprop.w": "fp4_e2m1"}}
    assert json.loads((linear / "pgq" / "recipe.json").read_text())["logits"] is None
    a, b = train_losses(linear), train_losses(logits)
    assert a[1] == b[1] == train_losses(plain)[1]
    assert a[2] != b[2] and a[3] != b[3]
    ckpt = str(tmp_path / "ckpt")
    args = [*FAST_ARGS, *LATE, "--train-iters", "3", "--pgq-logits"]
    launch([*args, "--save", ckpt, "--exit-interval", "2", "--run-dir", str(tmp_path / "c")])
    launch([*args, "--load", ckpt, "--no-save", "--run-dir", str(tmp_path / "d")])
    assert train_losses(tmp_path / "d") == {3: b[3]}
