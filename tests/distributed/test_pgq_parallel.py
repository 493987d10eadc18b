"""A PGQ profile at TP=2 (with and without sequence parallelism; torchrun on gloo) equals the
single-process one: every rank quantizes its shard, the sums of squares add up over ranks, so an
operand's SQNR is the unsharded operand's wherever the quantizer's blocks do not depend on the
split. Where they do, the profile says so in its metadata and the values differ: that is what
the sharded GEMM itself would see.

Which operands must agree (``comparable``): a replicated one (every rank holds the whole
tensor); one with one scale for the whole tensor (FP8 / FP4 per tensor; NVFP4's second level),
which every rank takes from the whole tensor's amax (a MAX all-reduce over the TP group, as the
quantized GEMM does); one split along another axis than the one it is quantized along; one
split along its quantization axis only for block-local formats (1x128 tiles, 128x128 blocks,
MX and NVFP4 blocks: every block inside one shard with these shapes), not for int8's per-row
scale. Sequence-parallel shards of the embedding's ``dy`` (64 tokens) cut the 128-token tiles:
not comparable. Round-to-nearest operands agree to float32 summation order (measured <= 1e-6
for FP8 / MX / int8, 1e-4 allowed; up to 1.7e-4 for NVFP4, whose coarse E4M3 block scale can
flip on a 1e-7 difference and move a whole block — one of the logits ``x``'s 8192 blocks is
~1.2e-4 of its noise: 1e-3 allowed); stochastic-rounding ones (``dy`` of int8 /
NVFP4 / MXFP4 / FP4) draw other numbers and agree statistically (measured <= 5 %, 10 %
allowed) — except NVFP4's on the logits' ``dy``, whose SQNR moves by +-15 % from one draw to the
next in a single process (a few ``p - 1`` entries per token set its E4M3 block scales and the
many tiny probabilities round to 0 or one step: heavy-tailed errors), so it is not compared."""

import pytest

from megatron_ext.formats import get_format
from megatron_ext.methods.pgq.profile import load_profile
from pretrain_runner import FAST_ARGS, launch

# every 128-tile / block inside one TP=2 shard: qkv 768 rows -> 384, fc1 1024 -> 512, proj and
# fc2 inputs 256 -> 128 and 512 -> 256, vocabulary 512 -> 256; a micro-batch is 128 tokens
ALIGNED = ["--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
           "--num-query-groups", "4", "--vocab-size", "512"]
PGQ = ["--precision", "pgq", "--pgq-profile-steps", "1", "--pgq-device", "none",
       "--pgq-candidates", "all",  # every candidate: the test compares them all
       "--train-iters", "1", "--lr-warmup-iters", "0", "--no-save"]
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]}


def _profile(tmp, name, nproc, *flags):
    run_dir = tmp / name
    launch([*FAST_ARGS, *ALIGNED, *PGQ, "--run-dir", str(run_dir), *flags], nproc=nproc,
           timeout=900)
    return load_profile(str(run_dir / "pgq" / "profile.json"))


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pgq_parallel")
    out = {"single": _profile(tmp, "single", 1)}
    for name, flags in LAYOUTS.items():
        out[name] = _profile(tmp, name, 2, *flags)
    return out


def _block_local(fmt: str) -> bool:
    return "@tile" in fmt or "@block" in fmt or fmt.startswith(("mx", "nvfp4"))


def comparable(gemm, sharded: str | None, fmt: str) -> bool:
    if sharded is None or get_format(fmt).scaling.rows is None:
        return True
    if sharded == "T":
        return False
    return sharded != gemm.contracting or _block_local(fmt)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp2_profile_equals_the_single_process_one(profiles, layout):
    single, parallel = profiles["single"], profiles[layout]
    assert parallel.model["tp"] == 2 and single.model["tp"] == 1
    assert parallel.losses == pytest.approx(single.losses, rel=1e-6)
    checked, per_shard = {True: 0, False: 0}, []
    for g1, g2 in zip(single.gemms, parallel.gemms, strict=True):
        assert (g1.name, g1.flops) == (g2.name, g2.flops)
        for role, op in g2.operands.items():
            for cand, fmt_of in parallel.candidates.items():
                fmt = fmt_of[role]
                expect, got = g1.operands[role].sqnr[cand], op.sqnr[cand]
                if not comparable(g2, op.sharded, fmt):
                    if fmt.startswith("int8") and op.sharded == g2.contracting:
                        per_shard.append(abs(got / expect - 1))
                    continue
                stochastic = get_format(fmt).stochastic
                if stochastic and fmt.startswith("nvfp4") and g2.site == "logits":
                    continue
                rel = 0.1 if stochastic else (1e-3 if fmt.startswith("nvfp4") else 1e-4)
                assert got == pytest.approx(expect, rel=rel), (
                    g2.name, role, cand)
                checked[stochastic] += 1
    assert checked[False] > 250 and checked[True] > 100
    # int8's per-row scales over a split reduction axis are per shard: visibly other values
    assert max(per_shard) > 1e-2
