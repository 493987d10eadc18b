"""Resume never changes the LR schedule silently: a mismatch between the flags and the
checkpoint is refused unless --use-checkpoint-opt_param-scheduler or
--override-opt_param-scheduler says which wins (Megatron-LM's flags); checked against closed
forms of the cosine schedule, in process and through pretrain_llama.py."""

import math

import pytest

from pretrain_runner import FAST_ARGS, launch, read_metrics
from megatron_ext.errors import UsageError
from megatron_ext.training.arguments import parse_args
from megatron_ext.training.optimizer import build_scheduler
from megatron_ext.training.schedule_resume import group_schedule, restore, saved_state

BASE = ["--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-iters", "10"]


class _Optimizer:
    """Parameter groups as megatron-core's ``get_megatron_optimizer`` makes them: each holds
    the peak and minimum LR its scheduler reads."""

    def __init__(self, args):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0, "max_lr": args.lr,
                              "min_lr": args.min_lr}]


def _cosine(step, lr, min_lr, warmup, decay):
    """Megatron's warm-up + cosine decay, written out (step = steps taken so far)."""
    if step < warmup:
        return lr * step / warmup
    if step > decay:
        return min_lr
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup)
                                                        / (decay - warmup)))


def _schedule(flags, saved=None, steps=0):
    """(scheduler, the line restore printed, the LRs of the next ``steps`` steps). With
    ``saved``, as ``Checkpointer.load``: the optimizer state (its groups) is loaded first."""
    args = parse_args("llama", [*BASE, *flags, "--no-save"], world_size=1)
    opt = _Optimizer(args)
    scheduler = build_scheduler(args, opt)
    line = None
    if saved is not None:
        flag_groups = group_schedule(opt)
        opt.param_groups[0].update(saved["groups"][0])
        line = restore(scheduler, saved, flag_groups)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return scheduler, line, lrs


@pytest.fixture
def after_100():
    """The state a 100-step run saves."""
    scheduler, _, _ = _schedule(["--train-iters", "100"], steps=100)
    return {**saved_state(scheduler), "groups": group_schedule(scheduler.optimizer)}


def test_a_longer_run_must_say_which_schedule(after_100):
    with pytest.raises(UsageError, match=r"--lr-decay-iters 100 in the checkpoint, 200 now\): "
                                         r"pass --use-checkpoint-opt_param-scheduler"):
        _schedule(["--train-iters", "200"], after_100)


def test_use_checkpoint_keeps_the_old_schedule(after_100):
    scheduler, line, lrs = _schedule(["--train-iters", "200", "--lr", "0.5",
                                      "--use-checkpoint-opt_param-scheduler"], after_100, 3)
    assert lrs == [0.1, 0.1, 0.1]  # past the old decay: the minimum
    assert (scheduler.max_lr, scheduler.lr_decay_steps) == (1.0, 100)
    assert "the checkpoint's (--use-checkpoint-opt_param-scheduler)" in line


def test_override_takes_the_flags_at_the_saved_step(after_100):
    scheduler, line, lrs = _schedule(["--train-iters", "200",
                                      "--override-opt_param-scheduler"], after_100, 3)
    assert lrs == pytest.approx([_cosine(s, 1.0, 0.1, 10, 200) for s in (100, 101, 102)],
                                rel=1e-12)
    assert scheduler.num_steps == 103
    assert "the flags' (--override-opt_param-scheduler)" in line


def test_override_takes_a_new_peak_and_minimum_lr(after_100):
    # megatron's scheduler reads the peak / minimum LR from the optimizer's parameter groups,
    # which the checkpoint's optimizer state brings back: override must put the flags' there
    flags = ["--train-iters", "200", "--lr", "0.5", "--min-lr", "0.05"]
    _, _, lrs = _schedule([*flags, "--override-opt_param-scheduler"], after_100, 2)
    _, _, fresh = _schedule(flags, steps=102)
    assert lrs == pytest.approx(fresh[100:], rel=1e-12)
    assert lrs == pytest.approx([_cosine(s, 0.5, 0.05, 10, 200) for s in (100, 101)], rel=1e-12)
    _, _, kept = _schedule([*flags, "--use-checkpoint-opt_param-scheduler"], after_100, 1)
    assert kept == [0.1]  # the checkpoint's minimum LR, from its groups


def test_matching_flags_need_no_choice(after_100):
    _, line, lrs = _schedule(["--train-iters", "300", "--lr-decay-iters", "100"], after_100, 1)
    assert lrs == [0.1] and "the flags agree" in line  # --train-iters alone is no schedule


def test_wsd_decay_is_saved_and_compared():
    wsd = ["--lr-decay-style", "WSD", "--train-iters", "100"]
    scheduler, _, _ = _schedule([*wsd, "--lr-wsd-decay-iters", "20"], steps=50)
    saved = {**saved_state(scheduler), "groups": group_schedule(scheduler.optimizer)}
    with pytest.raises(UsageError, match="--lr-wsd-decay-iters 20 in the checkpoint, 30 now"):
        _schedule([*wsd, "--lr-wsd-decay-iters", "30"], saved)
    kept, _, _ = _schedule([*wsd, "--lr-wsd-decay-iters", "30",
                            "--use-checkpoint-opt_param-scheduler"], saved)
    assert kept.wsd_decay_steps == 20


def test_through_pretrain(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    launch([*FAST_ARGS, "--train-iters", "4", "--save", ckpt, "--run-dir",
            str(tmp_path / "a")])
    resume = [*FAST_ARGS, "--train-iters", "6", "--load", ckpt, "--no-save"]
    proc = launch([*resume, "--run-dir", str(tmp_path / "b")], check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--lr-decay-iters 4 in the checkpoint, 6 now" in errors[0]
    new_lr = ["--lr", "1e-3", "--min-lr", "1e-4"]  # not the checkpoint's (3e-3, 3e-4)
    proc = launch([*resume, *new_lr, "--override-opt_param-scheduler",
                   "--run-dir", str(tmp_path / "c")])
    assert ("LR schedule: the flags' (--override-opt_param-scheduler): cosine from 0.001 to "
            "0.0001" in proc.stdout)
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "c") if "lr" in r}
    # a fresh run of these flags (warm-up 1: FAST_ARGS) runs step 5 at its scheduler's step-4 LR
    fresh = build_scheduler(parse_args("llama", [*resume, *new_lr], world_size=1), _Optimizer(
        parse_args("llama", [*resume, *new_lr], world_size=1)))
    fresh.step(increment=4)
    assert lrs[5] == pytest.approx(fresh.optimizer.param_groups[0]["lr"], rel=1e-6)
    assert lrs[5] == pytest.approx(_cosine(4, 1e-3, 1e-4, 1, 6), rel=1e-6)
