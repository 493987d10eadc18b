"""What a run holds is decided by its extensions (issue 24, items 2-3): a flag of an inactive
extension, a single-value flag given twice, a policy or optimizer of an extension not in the
run are each one ``UsageError`` line; the method configs are built once, in ``validate``."""

import re

import pytest

from megatron_ext.defaults import default_extensions
from megatron_ext.errors import UsageError
from megatron_ext.precision.controller import PlanController
from megatron_ext.precision.extension import PrecisionRun, precision_extension
from megatron_ext.methods.snip.extension import snip_extension
from megatron_ext.training.pretrain import pretrain

TINY = ["--mock-data", "--num-layers", "2", "--seq-length", "64", "--micro-batch-size", "2"]


def _refused(argv, extensions=None) -> str:
    with pytest.raises(UsageError) as info:
        pretrain("llama", [*TINY, *argv, "--dry-run"],
                 default_extensions() if extensions is None else extensions)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("argv, flag, needs", [
    (["--snip-budget", "0.3"], "--snip-budget", "--precision snip | min-abs-err"),
    (["--precision", "uniform:fp8", "--snip-budget=0.5"], "--snip-budget", "--precision snip"),
    (["--precision", "uniform:fp8", "--gnmr-lock", "3"], "--gnmr-lock", "--gnmr"),
    (["--pgq-format", "fp8"], "--pgq-format", "--precision pgq"),
    (["--gaussws-b-init", "5"], "--gaussws-b-init", "--gaussws SITES"),
    (["--stquant-block-size", "32"], "--stquant-block-size", "--optimizer stquant-adamw"),
])
def test_a_flag_of_an_inactive_extension_names_what_enables_it(argv, flag, needs):
    message = _refused(argv)
    assert message.startswith(f"{flag} is a flag of ") and needs in message, message


@pytest.mark.parametrize("argv, flags", [
    (["--precision", "snip", "--precision", "pgq"], "--precision"),
    (["--precision", "snip", "--snip-budget", "0.3", "--snip-budget=0.4"], "--snip-budget"),
    (["--optimizer", "adam", "--optimizer", "stquant-adamw"], "--optimizer"),
])
def test_an_extension_flag_given_twice_is_refused(argv, flags):
    assert _refused(argv).startswith(f"{flags} given 2 times: the flag takes one value")


def test_training_flags_keep_last_wins():
    """Training's own flags keep argparse's (and Megatron-LM's) last-wins: harnesses and
    compare grids override a base command line that way."""
    report = pretrain("llama", [*TINY, "--micro-batch-size", "1", "--dry-run"], [])
    assert "micro-batch 1 x" in report.header


def test_a_policy_whose_owner_is_not_in_the_run_cannot_be_chosen():
    controller = PlanController()
    snip_imported = snip_extension(controller)  # imported, built, but not in this run
    assert snip_imported.policies
    message = _refused(["--precision", "snip"], [precision_extension(PrecisionRun(controller))])
    assert message.startswith("--precision: unknown precision 'snip' in this run; choose one "
                              "of uniform:bf16"), message


def test_optimizer_choices_come_from_the_run():
    with pytest.raises(UsageError, match=re.escape("invalid choice: 'stquant-adamw' (choose "
                                                   "from 'adam')")):  # argparse's check, one line
        pretrain("llama", [*TINY, "--optimizer", "stquant-adamw", "--dry-run"], [])
    run = pretrain("llama", [*TINY, "--optimizer", "stquant-adamw", "--dry-run"],
                   default_extensions())
    assert "stquant" in run.parts


def test_gnmr_without_a_plan_is_refused_in_any_order():
    controller = PlanController()
    platform = precision_extension(PrecisionRun(controller))
    from megatron_ext.methods.gnmr.extension import gnmr_extension
    for order in ([gnmr_extension(controller), platform], [platform, gnmr_extension(controller)]):
        controller.plan_needed, controller.flags_read = [], False
        assert _refused(["--gnmr"], order).startswith("--gnmr promotes sites of a precision plan")


def test_snip_reads_its_flags_once_into_a_frozen_config():
    extensions = default_extensions()
    pretrain("llama", [*TINY, "--precision", "snip", "--snip-budget", "0.25", "--dry-run"],
             extensions)
    snip = next(e for e in extensions if e.name == "snip")
    config = snip.validate.__self__.config
    assert (config.policy, config.budget, len(config.options)) == ("snip", 0.25, 8)
    with pytest.raises(AttributeError):  # frozen
        config.budget = 0.5


def test_pgq_reads_its_flags_once_into_a_frozen_config():
    extensions = default_extensions()
    pretrain("llama", [*TINY, "--precision", "pgq", "--pgq-format", "fp8", "--pgq-candidates",
                       "int8,fp8", "--pgq-profile-steps", "3", "--dry-run"], extensions)
    config = next(e for e in extensions if e.name == "pgq").validate.__self__.config
    assert ((config.recipe.format, config.profile_steps, list(config.candidates)) ==
            ("fp8", 3, ["int8", "fp8"]))
    with pytest.raises(AttributeError):  # frozen
        config.profile_steps = 1
