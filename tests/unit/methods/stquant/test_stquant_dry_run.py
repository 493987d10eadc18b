"""STQuant's part of --dry-run: both moments' bytes per GPU at 4 and 8 bits, by hand."""

import pytest

from megatron_ext.methods.stquant.extension import stquant_extension
from megatron_ext.training.pretrain import pretrain

TINY = ["--mock-data", "--vocab-size", "4096", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--data-parallel-size", "2"]


@pytest.mark.parametrize("distributed", [True, False])
def test_column_is_two_moments_at_b_bits_plus_a_float32_scale_per_block(distributed, capsys):
    flags = ["--use-distributed-optimizer"] if distributed else []
    report = pretrain("llama", [*TINY, *flags, "--optimizer", "stquant-adamw",
                                "--stquant-block-size", "128", "--dry-run"],
                      [stquant_extension()])
    part = report.parts["stquant"]
    shards = 2 if distributed else 1
    for stage, got in zip(report.stages, part.stage_json):
        params = stage.params.per_gpu
        assert got["stquant_state_bytes_4bit"] == pytest.approx(params * 2 * 4.25 / 8 / shards)
        assert got["stquant_state_bytes_8bit"] == pytest.approx(params * 2 * 8.25 / 8 / shards)
    assert part.json["stquant"]["bytes_per_param"] == {"4": 1.0625, "8": 2.0625}
    assert "STQuant m, v: 1.062 B/param if every layer has 4 bits" in capsys.readouterr().out


def test_no_part_with_the_default_optimizer():
    report = pretrain("llama", [*TINY, "--dry-run"], [stquant_extension()])
    assert "stquant" not in report.parts
