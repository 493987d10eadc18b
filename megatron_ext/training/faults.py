"""Fault handling in the training loop: non-finite steps, rank desync, pre-emption (SIGTERM).

What and why:

* **Non-finite loss or gradients.** megatron-core's optimizer looks for inf/nan only when it
  scales the loss (FP16 with a grad scaler); in FP32 and BF16 runs it would apply a NaN update
  and ruin the weights for good. :func:`guarded_step` checks the loss and every gradient buffer,
  agrees across ranks (one all-reduce of two numbers) and skips the optimizer step when anything
  is non-finite: weights, Adam moments and the LR schedule stay as they were. The
  loop then calls every extension's ``on_nonfinite(args, run, state)`` hook (where a precision
  method can move the offending sites to high precision, e.g. GNMR); the
  :class:`FaultHandler` (an ordinary extension) counts skipped steps (``skipped`` /
  ``skipped_total`` in the metrics) and stops the run with a one-line error after
  ``--max-skipped-steps`` skipped steps in a row.
* **Rank desync.** A checkpoint holds one copy of the replicated state (iteration, consumed
  samples, every registered extension state such as the precision plan), written by rank 0. If
  ranks disagree, that copy is wrong for some of them. :func:`verify_ranks_agree` all-gathers a
  few int64 fingerprints before every save and aborts every rank, naming the ranks that differ.
* **Pre-emption.** With ``--exit-signal-handler`` (Megatron-LM's flag; on by default when
  checkpoints are saved) SIGTERM only sets a flag; the loop all-reduces it after every step, so
  all ranks stop after the same step, save a checkpoint and exit with status 0. Ctrl-C
  (SIGINT) does the same and then exits with status 130 (without the handler: at once, one
  line, status 130).
* **Fault injection** flags (``--inject-*``) exist so that tests can exercise these paths
  through the real entry points.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import threading

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from megatron_ext.training.distributed import device
from megatron_ext.errors import UsageError
from megatron_ext.extension import Extension


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault handling")
    g.add_argument("--max-skipped-steps", type=int, default=10, metavar="N",
                   help="a step whose loss or gradients are not finite is skipped (no update); "
                        "stop the run (exit status 2) after N such steps in a row")
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=None,
                   help="on SIGTERM (e.g. SLURM pre-emption) finish the current step on every "
                        "rank, save a checkpoint and exit with status 0; on SIGINT (Ctrl-C) the "
                        "same, exit status 130 (default: on when checkpoints are saved)")
    t = parser.add_argument_group("fault injection (for testing the fault handling)")
    t.add_argument("--inject-nonfinite-at-step", type=int, nargs="+", default=[], metavar="K",
                   help="make the loss, and so every gradient, NaN at these steps")
    t.add_argument("--inject-desync-on-rank", type=int, default=None, metavar="R",
                   help="after step 1, rank R counts one consumed sample more than the others "
                        "(the next checkpoint save must catch it)")


def validate_args(args: argparse.Namespace) -> None:
    """Range checks; resolves the ``--exit-signal-handler`` default from ``--save``."""
    if args.max_skipped_steps < 1:
        raise UsageError("--max-skipped-steps must be >= 1")
    if any(step < 1 for step in args.inject_nonfinite_at_step):
        raise UsageError("--inject-nonfinite-at-step: steps are numbered from 1")
    rank = args.inject_desync_on_rank
    if rank is not None and not 0 <= rank < args.world_size:
        raise UsageError(f"--inject-desync-on-rank {rank}: the world has ranks "
                         f"0-{args.world_size - 1}")
    if args.exit_signal_handler is None:
        args.exit_signal_handler = bool(args.save)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---------------------------------------------------------------- non-finite steps

def _grad_tensors(model: list) -> list[torch.Tensor]:
    """This rank's gradients: megatron DDP's contiguous grad buffers, else each parameter's."""
    grads = []
    for chunk in model:
        buffers = getattr(chunk, "buffers", None)
        if isinstance(buffers, list):
            grads += [b.grad_data for b in buffers + getattr(chunk, "expert_parallel_buffers", [])]
            continue
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads.append(g)
    return grads


def local_grads_finite(model: list) -> torch.Tensor:
    """Whether every gradient element on this rank is finite: a 0-dim bool tensor on the
    device, not read here (:func:`guarded_step` reads the all-reduced verdict once). One sum
    per buffer: a sum is non-finite exactly when an element is (or when it overflows FP32,
    which clipping could not survive either), and it needs no temporary as large as the
    buffer."""
    sums = [g.sum(dtype=torch.float32) for g in _grad_tensors(model)]
    if not sums:
        return torch.ones((), dtype=torch.bool, device=device())
    verdict = torch.isfinite(torch.stack(sums).sum())
    if hasattr(verdict, "full_tensor"):  # FSDP2's sharded gradients: a DTensor, made whole
        verdict = verdict.full_tensor()
    return verdict


def _has_grad_scaler(optimizer) -> bool:
    """FP16 loss scaling: megatron checks for inf/nan itself and must see the overflow to
    lower the scale, so its own ``step`` decides."""
    return any(getattr(opt, "grad_scaler", None) is not None
               for opt in getattr(optimizer, "chained_optimizers", [optimizer]))


def guarded_step(optimizer, model: list, loss: float) -> tuple[bool, float]:
    """The optimizer step, unless the loss or any rank's gradients are non-finite: then no
    update at all. Collective (all ranks agree). Returns (update_ok, grad_norm)."""
    if _has_grad_scaler(optimizer):
        update_ok, grad_norm, _ = optimizer.step()
        return update_ok, float(grad_norm) if update_ok and grad_norm is not None else math.nan
    bad = local_grads_finite(model).logical_not().to(torch.int32).reshape(1)
    if not math.isfinite(loss):
        bad.fill_(1)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        return False, math.nan
    update_ok, grad_norm, _ = optimizer.step()
    return update_ok, float(grad_norm) if grad_norm is not None else math.nan


class FaultHandler:
    """One run's fault state: skipped-step counters (checkpointed), the SIGTERM flag, the
    fault injection hooks. An ordinary extension (:meth:`extension`), first in the defaults."""

    def __init__(self):
        self.args: argparse.Namespace | None = None
        self.consecutive = 0
        self.total = 0
        self.signalled = 0
        """0, or the number of the stop signal received (SIGTERM, or SIGINT: Ctrl-C)."""
        self.interrupted = ""
        """Set when a Ctrl-C stopped training: what happened, for the exit-130 line."""
        self._abort: str | None = None
        self._state = None
        self._previous_handlers: dict = {}
        self._hook_handles = []

    def configure(self, args: argparse.Namespace) -> None:
        validate_args(args)
        self.args = args

    def extension(self) -> Extension:
        """The flags, their validation, the checkpointed counters and the per-step handling."""
        return Extension(name="faults", add_arguments=add_arguments, validate=self.configure,
                         after_setup=self.after_setup, on_train_start=self.start,
                         on_train_end=self.close, on_nonfinite=self.on_nonfinite,
                         on_step=self.on_step, should_stop=self.should_stop)

    def after_setup(self, args, run, state) -> None:
        run.checkpointer.register("faults", self)

    def state_dict(self) -> dict:
        return {"skipped_total": self.total, "skipped_in_a_row": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state.get("skipped_total", 0))
        self.consecutive = int(state.get("skipped_in_a_row", 0))

    def start(self, args, run, state) -> None:
        """Training begins: install the SIGTERM / SIGINT handler and the injection hook (if
        asked)."""
        self._state = state
        if args.exit_signal_handler and threading.current_thread() is threading.main_thread():
            self._previous_handlers = {sig: signal.signal(sig, self._on_signal)
                                       for sig in (signal.SIGTERM, signal.SIGINT)}
        if args.inject_nonfinite_at_step:
            self._hook_handles = [m.register_forward_hook(self._poison)
                                  for m in unwrap_model(run.model) if getattr(m, "post_process", 1)]

    def close(self, args=None, run=None, state=None) -> None:
        """Restore the previous signal handlers and remove the injection hooks; after a stop
        by Ctrl-C, ``KeyboardInterrupt`` (the entry point exits with status 130)."""
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        if self.interrupted:
            raise KeyboardInterrupt(self.interrupted)

    def _on_signal(self, signum, frame) -> None:
        # acted on after the current step (no I/O inside a handler); if both came, SIGTERM
        # (15 > 2): a pre-emption ends with status 0
        self.signalled = max(self.signalled, int(signum))

    def _poison(self, module, inputs, output):
        """Forward hook on the last stage: the per-token losses become NaN at the chosen
        steps, so the loss and, through backward, every gradient are NaN."""
        if module.training and self._state.iteration + 1 in self.args.inject_nonfinite_at_step:
            return output * float("nan")
        return output

    def on_nonfinite(self, args, run, state) -> None:
        """Count a skipped step (every rank sees the same ``skipped``); after too many in a
        row, :meth:`should_stop` aborts (once the step is logged)."""
        self.consecutive += 1
        self.total += 1
        self._report_skip(state, run.step_result["loss"])
        if self.consecutive >= args.max_skipped_steps:
            first = state.iteration - self.consecutive + 1
            self._abort = (f"training stopped: {self.consecutive} steps in a row (steps "
                           f"{first}-{state.iteration}) had a non-finite loss or gradients and "
                           f"were skipped (--max-skipped-steps {args.max_skipped_steps})")

    def on_step(self, args, run, state) -> dict:
        """The step's fault metrics (``skipped``, ``skipped_total``)."""
        self._inject_desync(state)
        skipped = run.step_result["skipped"]
        if not skipped:
            self.consecutive = 0
        return {"skipped": skipped, "skipped_total": self.total}

    def _report_skip(self, state, loss: float) -> None:
        if _rank() == 0:
            print(f"step {state.iteration}: non-finite loss or gradients (loss {loss}): update "
                  f"skipped ({self.consecutive} in a row, {self.total} in total, stop at "
                  f"--max-skipped-steps {self.args.max_skipped_steps})"
                  f"{first_step_suspects(self.args, state.iteration)}", flush=True)

    def _inject_desync(self, state) -> None:
        if self.args.inject_desync_on_rank == _rank() and state.iteration == 1:
            state.consumed_samples += 1

    def should_stop(self, args, run, state) -> bool:
        """End of a step: ``UsageError`` (abort, no checkpoint) after too many non-finite steps
        in a row; True (save and stop) if any rank got SIGTERM or SIGINT. With the signal
        handler on this is collective (one all-reduce of one number), so all ranks stop after
        the same step."""
        if self._abort:
            raise UsageError(self._abort)
        if not args.exit_signal_handler:
            return False
        flag = torch.tensor([self.signalled], dtype=torch.int32, device=device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return False
        name = signal.Signals(flag.item()).name
        then = ("saving a checkpoint and exiting" if args.save
                else "exiting (no checkpoint: --no-save)")
        if _rank() == 0:
            print(f"received {name}: stopping after step {state.iteration}, {then}", flush=True)
        if flag.item() == signal.SIGINT:
            self.interrupted = (f"stopped after step {state.iteration}" +
                                (", checkpoint saved" if args.save else ""))
        return True


def first_step_suspects(args, iteration: int) -> str:
    """At step 1 no update has happened yet: a non-finite loss there comes from the flags
    that shape the forward pass (or an injection); the text naming them, else ''."""
    if iteration != 1:
        return ""
    if 1 in args.inject_nonfinite_at_step:
        return "; at step 1: --inject-nonfinite-at-step 1"
    return (f"; at step 1, before any update, so from the forward pass: check --init-method-std "
            f"{args.init_method_std:g}, --norm-epsilon {args.norm_epsilon:g}, --rotary-base "
            f"{args.rotary_base:g}, --seq-length {args.seq_length} and the data")


# ---------------------------------------------------------------- rank desync

def _state_hash(state) -> int:
    """A signed int64 naming ``state`` (a replicated extension state dict) by content."""

    def canonical(obj):
        if torch.is_tensor(obj):
            obj = obj.detach().cpu().contiguous()
            return (f"tensor:{obj.dtype}:{tuple(obj.shape)}:" +
                    hashlib.sha256(obj.view(torch.uint8).numpy().tobytes()).hexdigest())
        return repr(obj)

    text = json.dumps(state, sort_keys=True, default=canonical)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def save_fingerprint(train_state, extra: dict) -> dict[str, int]:
    """What every rank must agree on before a checkpoint save: the step counter, the data
    position, and a hash of each registered extension state (the precision plan, ...)."""
    fields = {"iteration": train_state.iteration,
              "consumed_samples": train_state.consumed_samples}
    for name, provider in sorted(extra.items()):
        fields[f"{name} state"] = _state_hash(provider.state_dict())
    return fields


def desync_message(names: list[str], rows: list[list[int]], where: str) -> str | None:
    """One line naming each field on which ranks differ from rank 0 (and those ranks), or
    None if all rows agree. ``rows[r]`` holds rank r's values in ``names`` order."""
    problems = []
    for i, name in enumerate(names):
        ranks = [r for r, row in enumerate(rows) if row[i] != rows[0][i]]
        if not ranks:
            continue
        shown = ", ".join(f"rank {r}: {rows[r][i]}" for r in [0, *ranks[:3]])
        values = "" if name.endswith(" state") else f" ({shown})"
        problems.append(f"{name} differs on rank(s) {', '.join(map(str, ranks))}{values}")
    if not problems:
        return None
    return f"rank desync at {where}: {'; '.join(problems)} -- stopping all ranks"


def verify_ranks_agree(fields: dict[str, int], where: str) -> None:
    """All-gather ``fields`` (name -> int64) from every rank; ``UsageError`` on every rank,
    naming the ranks that differ from rank 0, if they do not all hold the same values."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    message = desync_message(list(fields), [t.tolist() for t in gathered], where)
    if message:
        raise UsageError(message)
