"""Each method says in one start-up line that it is on and with what settings; a run
without it prints no line for it (``Extension.describe``, printed by pretrain after the
model line)."""

import pytest

from megatron_ext import extension as ext
from megatron_ext.defaults import default_extensions
from megatron_ext.training.pretrain import parse_and_validate

METHODS = {
    "snip": (["--precision", "snip", "--snip-budget", "0.75"], ["E_t 0.75", "step 50"]),
    "gnmr": (["--precision", "uniform:fp4", "--gnmr", "--gnmr-lock", "7"], ["lock 7 steps"]),
    "pgq": (["--precision", "pgq", "--pgq-format", "fp8"], ["format fp8"]),
    "gaussws": (["--gaussws", "od", "--gaussws-block", "16"], ["proj,fc2", "16x16 tile"]),
    "stquant": (["--optimizer", "stquant-adamw", "--stquant-block-size", "128"],
                ["128-element blocks", "4/8/16/32 bits"]),
}


def start_lines(argv: list[str]) -> list[str]:
    """The ``describe`` lines a run with ``argv`` prints (flags parsed and validated as
    pretrain does, nothing built)."""
    extensions = default_extensions()
    args, _ = parse_and_validate("llama", ["--mock-data", *argv], extensions)
    return [line for describe in ext.hooks(extensions, "describe")
            if (line := describe(args)) is not None]


@pytest.mark.parametrize("method", list(METHODS))
def test_a_method_says_it_is_on_in_one_line(method):
    argv, settings = METHODS[method]
    lines = start_lines(argv)
    assert [line.split(":")[0] for line in lines] == [method]
    assert lines[0].startswith(f"{method}: on") and "\n" not in lines[0]
    assert all(s in lines[0] for s in settings), lines[0]


def test_a_run_without_methods_prints_no_method_line():
    assert start_lines([]) == [] and start_lines(["--precision", "uniform:fp8"]) == []


def test_a_snip_baseline_says_which():
    assert start_lines(["--precision", "min-rel-err"])[0].startswith("snip: baseline min-rel-err")
