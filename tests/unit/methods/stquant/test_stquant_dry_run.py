"""STQuant's part of --dry-run: both moments at b bits plus an FP32 scale per block, in place of
FP32 Adam's m, v in the optimizer memory, against a hand computation."""

import pytest

from megatron_ext.methods.stquant.extension import stquant_extension
from megatron_ext.training.pretrain import pretrain

TINY = ["--mock-data", "--vocab-size", "4096", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--data-parallel-size", "2"]


def dry_run(flags):
    return pretrain("llama", [*TINY, *flags, "--dry-run"], [stquant_extension()])


@pytest.mark.parametrize("flags, bits, distributed, bf16", [
    ([], 8, True, True),  # the default: 8 bits
    (["--stquant-fixed-bits", "4"], 4, False, True),  # a fixed width is the default
    (["--stquant-fixed-bits", "4", "--stquant-dry-run-bits", "16"], 16, True, False),
    (["--stquant-dry-run-bits", "32"], 32, False, False),  # float32, no scales: 8 B/param
])
def test_optimizer_memory_counts_the_moments_at_b_bits(flags, bits, distributed, bf16, capsys):
    more = ((["--use-distributed-optimizer"] if distributed else []) +
            (["--bf16"] if bf16 else ["--no-bf16"]))
    report = dry_run([*more, "--optimizer", "stquant-adamw", "--stquant-block-size", "128",
                      *flags])
    fp32 = dry_run(more)  # the same job with FP32 Adam
    shards = 2 if distributed else 1
    per_param = {4: 2 * 4.25 / 8, 8: 2 * 8.25 / 8, 16: 2 * 16.25 / 8, 32: 8.0}[bits]
    main = 4 if bf16 else 0  # FP32 main copies of BF16 weights
    part = report.parts["stquant"]
    for stage, json, plain in zip(report.stages, part.stage_json, fp32.stages):
        params = stage.params.per_gpu
        assert json["stquant_state_bytes"] == pytest.approx(params * per_param / shards)
        assert stage.memory.optimizer == pytest.approx(params * (per_param + main) / shards)
        assert plain.memory.optimizer == pytest.approx(params * (8 + main) / shards)
        assert stage.memory.total - plain.memory.total == pytest.approx(
            params * (per_param - 8) / shards)
    assert part.columns == ("m,v GiB",)
    assert part.json["stquant"] == {"bits": bits, "bytes_per_param": per_param, "block": 128}
    out = capsys.readouterr().out
    assert f"STQuant m, v: {per_param:.3f} B/param with every layer at {bits} bits" in out
    assert f"STQuant m, v at {bits} bits {per_param:.3f} B/param" in out  # the memory note


def test_no_part_with_the_default_optimizer():
    report = dry_run([])
    assert "stquant" not in report.parts
