"""Fault handling: non-finite steps are skipped (weights, optimizer and schedule untouched),
counted, reported to extensions and stop the run after --max-skipped-steps in a row; the desync
check names the ranks that differ. In process where the logic is the point, through
pretrain_llama.py where megatron's optimizer and real checkpoints are."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pretrain_runner import FAST_ARGS, launch, read_metrics
from megatron_ext.training.arguments import parse_args
from megatron_ext.errors import UsageError
from megatron_ext.extension import Extension, args_provider
from megatron_ext.training import loop
from megatron_ext.training.faults import (FaultHandler, desync_message, guarded_step,
                                          local_grads_finite, save_fingerprint)
from megatron_ext.training.loop import TrainState


def _args(argv=(), world_size=1, handler=None):
    handler = handler or FaultHandler()
    args = parse_args("llama", list(argv), args_provider([handler.extension()]), world_size)
    handler.configure(args)
    return args


def test_flag_defaults():
    args = _args()
    assert args.max_skipped_steps == 10 and args.inject_nonfinite_at_step == []
    assert args.exit_signal_handler is True  # checkpoints are saved by default
    assert _args(["--no-save"]).exit_signal_handler is False
    assert _args(["--no-save", "--exit-signal-handler"]).exit_signal_handler is True
    assert _args(["--no-exit-signal-handler"]).exit_signal_handler is False


@pytest.mark.parametrize("argv, world_size, message", [
    (["--max-skipped-steps", "0"], 1, "--max-skipped-steps must be >= 1"),
    (["--inject-nonfinite-at-step", "0"], 1, "steps are numbered from 1"),
    (["--inject-desync-on-rank", "2"], 2, "the world has ranks 0-1"),
])
def test_bad_flags(argv, world_size, message):
    with pytest.raises(UsageError, match=message):
        _args(argv, world_size)


def _model_with_grads(*values):
    model = [torch.nn.Linear(len(values), 1)]
    model[0].weight.grad = torch.tensor([list(values)])
    model[0].bias.grad = torch.zeros(1)
    return model


def test_local_grads_finite():
    assert local_grads_finite(_model_with_grads(1.0, -2.0)).item()
    assert not local_grads_finite(_model_with_grads(1.0, math.nan)).item()
    assert not local_grads_finite(_model_with_grads(math.inf, 1.0)).item()
    assert not local_grads_finite(_model_with_grads(math.inf, -math.inf)).item()  # sums to nan
    assert local_grads_finite([torch.nn.Linear(2, 1)]).item()  # no gradients at all


class RecordingOptimizer:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1
        return True, 0.5, None


@pytest.mark.parametrize("loss, grads, stepped", [
    (2.0, (1.0, 1.0), True),
    (math.nan, (1.0, 1.0), False),
    (2.0, (1.0, math.nan), False),
    (math.inf, (math.inf, 1.0), False),
])
def test_guarded_step(loss, grads, stepped):
    optimizer = RecordingOptimizer()
    update_ok, grad_norm = guarded_step(optimizer, _model_with_grads(*grads), loss)
    assert optimizer.steps == int(stepped) and update_ok is stepped
    assert grad_norm == 0.5 if stepped else math.isnan(grad_norm)


def test_fp16_loss_scaling_is_left_to_megatron():
    optimizer = RecordingOptimizer()
    optimizer.grad_scaler = object()  # megatron finds the overflow and lowers the scale itself
    guarded_step(optimizer, _model_with_grads(math.nan, 1.0), math.nan)
    assert optimizer.steps == 1


def test_skips_are_counted_reported_and_stop_the_run():
    calls = []

    def fallback(args, run, state):
        calls.append(state.iteration)
        return {"fallback_sites": 2}

    handler = FaultHandler()
    extensions = [handler.extension(), Extension("fallback", on_nonfinite=fallback)]
    args = _args(["--max-skipped-steps", "3"], handler=handler)
    state, records, run = TrainState(), [], SimpleNamespace(step_result={})
    with pytest.raises(UsageError) as error:
        for skipped in (True, True, False, True, True, True):
            state.iteration += 1
            run.step_result = {"skipped": skipped, "loss": math.nan}
            records.append(loop._after_step(args, run, state, extensions))  # as the loop does
            loop._should_stop(args, run, state, extensions)
    assert state.iteration == 6
    assert str(error.value) == ("training stopped: 3 steps in a row (steps 4-6) had a "
                                "non-finite loss or gradients and were skipped "
                                "(--max-skipped-steps 3)")
    assert calls == [1, 2, 4, 5, 6]
    assert records[0] == {"skipped": True, "skipped_total": 1, "fallback_sites": 2}
    assert records[2] == {"skipped": False, "skipped_total": 2}
    assert handler.state_dict() == {"skipped_total": 5, "skipped_in_a_row": 3}


def test_desync_message_names_fields_and_ranks():
    names = ["iteration", "consumed_samples", "precision_plan state"]
    same = [[4, 32, 77]] * 4
    assert desync_message(names, same, "step 4") is None
    rows = [[4, 32, 77], [4, 33, 77], [4, 32, -5], [4, 33, 77]]
    assert desync_message(names, rows, "the checkpoint save of step 4") == (
        "rank desync at the checkpoint save of step 4: consumed_samples differs on rank(s) 1, 3 "
        "(rank 0: 32, rank 1: 33, rank 3: 33); precision_plan state differs on rank(s) 2 -- "
        "stopping all ranks")


class Provider:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def test_save_fingerprint_covers_every_registered_state():
    plan = {"plan": {"sites": {"L0.qkv": {"x": "fp8_e4m3"}}}}
    other = {"plan": {"sites": {"L0.qkv": {"x": "fp4_e2m1"}}}}
    fp = save_fingerprint(TrainState(4, 32), {"precision_plan": Provider(plan),
                                              "stats": Provider({"t": torch.ones(3)})})
    assert list(fp) == ["iteration", "consumed_samples", "precision_plan state", "stats state"]
    assert fp == save_fingerprint(TrainState(4, 32), {"stats": Provider({"t": torch.ones(3)}),
                                                      "precision_plan": Provider(dict(plan))})
    changed = save_fingerprint(TrainState(4, 32), {"precision_plan": Provider(other),
                                                   "stats": Provider({"t": torch.zeros(3)})})
    assert changed["precision_plan state"] != fp["precision_plan state"]
    assert changed["stats state"] != fp["stats state"]


# ----------------------------------------------------------------- through pretrain_llama.py

def checkpoint_tensors(ckpt_dir) -> dict[str, torch.Tensor]:
    """Every tensor (model and optimizer) of a dist_checkpointing checkpoint, one process."""
    reader = dcp.FileSystemReader(str(ckpt_dir))
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in reader.read_metadata().state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nonfinite_steps_are_skipped_and_the_run_continues(tmp_path):
    save = tmp_path / "ckpt"
    launch([*FAST_ARGS, "--train-iters", "4", "--save-interval", "1", "--run-dir",
            str(tmp_path / "run"), "--save", str(save), "--inject-nonfinite-at-step", "2", "3",
            "--max-skipped-steps", "3"])
    steps = {r["step"]: r for r in read_metrics(tmp_path / "run") if "loss" in r}
    assert [steps[s]["skipped"] for s in range(1, 5)] == [False, True, True, False]
    assert [steps[s]["skipped_total"] for s in range(1, 5)] == [0, 1, 2, 2]
    assert math.isnan(steps[2]["loss"]) and math.isfinite(steps[4]["loss"])
    assert steps[4]["lr"] == steps[3]["lr"] == steps[2]["lr"]  # the schedule did not move
    tensors = {s: checkpoint_tensors(save / f"iter_{s:07d}") for s in range(1, 5)}
    assert len(tensors[1]) > 20  # model and optimizer state
    assert _same(tensors[1], tensors[2]) and _same(tensors[2], tensors[3])  # skipped
    assert not _same(tensors[3], tensors[4])  # step 4 updated


def test_too_many_nonfinite_steps_in_a_row_stop_the_run(tmp_path):
    proc = launch([*FAST_ARGS, "--train-iters", "8", "--no-save", "--run-dir",
                   str(tmp_path / "run"), "--inject-nonfinite-at-step", "2", "3", "4",
                   "--max-skipped-steps", "3"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: training stopped: 3 steps in a row (steps 2-4) had a non-finite "
                      "loss or gradients and were skipped (--max-skipped-steps 3)"]
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4]


def test_a_nonfinite_first_step_names_the_flags_of_the_forward_pass():
    from megatron_ext.training.faults import first_step_suspects

    args = SimpleNamespace(inject_nonfinite_at_step=[], init_method_std=0.02, norm_epsilon=1e-5,
                           rotary_base=10000.0, seq_length=64)
    assert first_step_suspects(args, 1) == (
        "; at step 1, before any update, so from the forward pass: check --init-method-std "
        "0.02, --norm-epsilon 1e-05, --rotary-base 10000, --seq-length 64 and the data")
    assert first_step_suspects(args, 2) == ""  # after an update: the update may be the cause
    args.inject_nonfinite_at_step = [1]
    assert first_step_suspects(args, 1) == "; at step 1: --inject-nonfinite-at-step 1"
