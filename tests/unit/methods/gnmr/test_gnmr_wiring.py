"""GNMR's wiring pieces in process: which gradient elements a DP rank owns under the
distributed optimizer (against a brute-force element map), the flags' one-line errors, and
the dry run's App. D bound against numbers worked out by hand."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from megatron_ext.defaults import default_extensions
from megatron_ext.errors import UsageError
from megatron_ext.methods.gnmr.flags import add_arguments, config_from_args
from megatron_ext.methods.gnmr.grads import shard_overlap
from megatron_ext.training.pretrain import pretrain


@pytest.mark.parametrize("seed", range(5))
def test_every_element_owned_by_the_rank_whose_shard_holds_it(seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 5))
    # buckets of random parameters, each bucket padded to a multiple of the DP size
    params, buckets, offset = [], [], 0
    for _ in range(int(rng.integers(1, 4))):
        start = offset
        for numel in rng.integers(1, 40, size=int(rng.integers(1, 5))):
            params.append((offset, offset + int(numel), len(buckets)))
            offset += int(numel)
        offset += (-(offset - start)) % size + size * int(rng.integers(0, 2))
        buckets.append((start, offset - start))
    owner = np.full(offset, -1)  # brute force: the rank whose shard holds each element
    for start, numel in buckets:
        shard = numel // size
        for r in range(size):
            owner[start + r * shard: start + (r + 1) * shard] = r
    for start, end, b in params:
        seen = np.zeros(end - start, dtype=int)
        for r in range(size):
            lo, hi = shard_overlap(start, end, *buckets[b], r, size)
            assert 0 <= lo <= hi <= end - start
            assert (owner[start + lo: start + hi] == r).all()
            seen[lo:hi] += 1
        assert (seen == 1).all()  # each element counted on exactly one rank


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.use_torch_fsdp2, args.use_megatron_fsdp = False, False
    return config_from_args(args)


def test_flags_make_the_config():
    assert _parse([]) is None
    config = _parse(["--gnmr", "--gnmr-max-promoted", "3", "--gnmr-alpha", "1.5",
                     "--gnmr-compare", "excess", "--gnmr-granularity", "site"])
    assert ((config.max_promoted, config.alpha, config.compare, config.granularity) ==
            (3, 1.5, "excess", "site"))
    assert config.lock == 10 and config.beta == 1.5  # the rest: GnmrConfig's defaults
    assert _parse(["--gnmr", "--gnmr-max-promoted", "0.5"]).max_promoted == 0.5
    config = _parse(["--gnmr", "--gnmr-rule", "static-topk", "--gnmr-topk", "2"])
    assert (config.rule, config.topk) == ("static-topk", 2)
    config = _parse(["--gnmr", "--gnmr-rule", "autoswitch", "--gnmr-autoswitch-mse", "0.01",
                     "--gnmr-autoswitch-underflow-pct", "50"])
    assert (config.autoswitch_mse, config.autoswitch_underflow_pct) == (0.01, 50.0)
    assert _parse(["--gnmr"]).rule == "gnmr"


@pytest.mark.parametrize("argv, message", [
    (["--gnmr", "--gnmr-lock", "0"], "--gnmr-lock must be an integer >= 1"),
    (["--gnmr", "--gnmr-max-promoted", "many"], "--gnmr-max-promoted must be a count"),
    (["--gnmr", "--gnmr-max-promoted", "1.5"], "--gnmr-max-promoted fraction must be in (0, 1]"),
    (["--gnmr", "--gnmr-alpha", "-1"], "--gnmr-alpha must be a number > 0"),
    (["--gnmr", "--gnmr-warmup-frac", "2"], "--gnmr-warmup-frac must be in [0, 1]"),
    (["--gnmr", "--gnmr-topk", "2"], "--gnmr-topk is for --gnmr-rule first-last / static-topk"),
    (["--gnmr", "--gnmr-rule", "first-last", "--gnmr-autoswitch-mse", "1"],
     "--gnmr-autoswitch-mse is for --gnmr-rule autoswitch, not first-last"),
    (["--gnmr", "--gnmr-rule", "autoswitch", "--gnmr-autoswitch-underflow-pct", "-1"],
     "--gnmr-autoswitch-underflow-pct must be a number >= 0"),
    (["--gnmr", "--gnmr-rule", "first-last", "--gnmr-topk", "-2"],
     "--gnmr-topk must be an integer >= 0"),
])
def test_bad_flags_are_one_line(argv, message):
    with pytest.raises(UsageError) as info:
        _parse(argv)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_fsdp_is_refused():
    from megatron_ext.extension import refuse_conflicts
    from megatron_ext.methods.gnmr.extension import gnmr_extension

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--gnmr"])
    for fsdp2, megatron_fsdp in ((True, False), (False, True)):
        args.use_torch_fsdp2, args.use_megatron_fsdp = fsdp2, megatron_fsdp
        with pytest.raises(UsageError, match="gnmr does not run with --use-"):
            refuse_conflicts([gnmr_extension(None)], args)
    args.gnmr = False  # off: its conflicts do not apply
    refuse_conflicts([gnmr_extension(None)], args)


# tiny llama (h 128, 4 heads of 32, 2 KV groups, SwiGLU 352), TP=2 x PP=2, 4 micro-batches
# of 2 x 64 tokens; one GPU keeps for wgrad (no SP): qkv, fc1 T x K, proj, fc2 T x K/2
TINY = ["--mock-data", "--vocab-size", "4096", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--precision", "uniform:fp4", "--gnmr"]
SAVED = 128 * 128 + 128 * 128 / 2 + 128 * 128 + 128 * 352 / 2  # qkv, proj, fc1, fc2


@pytest.mark.parametrize("extra, budget", [([], 1), (["--gnmr-max-promoted", "2"], 2)])
def test_dry_run_bound_by_hand(tmp_path, capsys, extra, budget):
    out = tmp_path / "r.json"
    report = pretrain("llama", [*TINY, *extra, "--dry-run", "--dry-run-json", str(out)],
                      default_extensions())
    unit = SAVED * (8.25 - 4.25) / 8  # FP4 tiles (4.25 bits) -> FP8 tiles (8.25 bits)
    held = [2, 1]  # 1F1B: stage k holds min(p - k, m) micro-batches
    part = report.parts["gnmr"]
    assert ([s["gnmr_extra_bytes"] for s in part.stage_json] ==
            [held[k] * budget * unit for k in (0, 1)])
    saved = json.loads(out.read_text())
    assert saved["gnmr"] == {"units": 4, "granularity": "block", "max_promoted": budget,
                             "allreduce_bytes": 32}
    text = capsys.readouterr().out
    assert "GNMR +MiB" in text and "GNMR: 4 units (block)" in text
    # the bound is reported, not added to the stage's memory total
    plain = pretrain("llama", [a for a in TINY if a != "--gnmr"] + ["--dry-run"],
                     default_extensions())
    assert [s.memory.total for s in report.stages] == [s.memory.total for s in plain.stages]


def test_static_topk_without_a_warmup_is_one_line():
    """The warm-up length depends on --train-iters: refused when the run is validated."""
    with pytest.raises(UsageError, match="^--gnmr-rule static-topk chooses after the warm-up"):
        pretrain("llama", [*TINY, "--gnmr-rule", "static-topk", "--gnmr-warmup-frac", "0.01",
                           "--train-iters", "20", "--dry-run"], default_extensions())
