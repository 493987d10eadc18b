"""LR schedules (megatron's OptimizerParamScheduler as we configure it) vs closed forms."""

import math

import pytest

from megatron_ext.training.arguments import parse_args
from megatron_ext.training.optimizer import build_scheduler


class _Optimizer:
    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def _lrs(flags, steps):
    args = parse_args("llama", flags + ["--no-save"])
    opt = _Optimizer()
    sched = build_scheduler(args, opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step(increment=1)
    return out


def _expected(style, step, lr=1.0, min_lr=0.1, warmup=10, decay=100, wsd=20):
    if step < warmup:
        return lr * step / warmup if warmup else lr
    if step > decay:
        return min_lr
    frac = (step - warmup) / (decay - warmup)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * frac) + 1)
    if style == "linear":
        return min_lr + (lr - min_lr) * (1 - frac)
    if style == "WSD":
        start = decay - wsd
        return lr if step <= start else min_lr + (lr - min_lr) * (1 - (step - start) / wsd)
    return lr


@pytest.mark.parametrize("style", ["cosine", "linear", "WSD", "constant"])
def test_schedule_matches_closed_form(style):
    flags = ["--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-iters", "10", "--train-iters",
             "100", "--lr-decay-style", style, "--lr-wsd-decay-iters", "20"]
    got = _lrs(flags, 100)
    for step, value in enumerate(got):
        assert value == pytest.approx(_expected(style, step), abs=1e-9), (style, step)
