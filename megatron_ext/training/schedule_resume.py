"""Resuming the learning-rate schedule: the checkpoint's or the flags', never a silent mix.

A checkpoint holds the LR schedule it was trained on (megatron-core's
``OptimizerParamScheduler.state_dict``: peak and minimum LR, warm-up and decay steps, decay
style, weight decay; here also the WSD decay length and style). On ``--load`` the flags may
describe another one -- ``--train-iters 800`` after a 400-step run moves the default
``--lr-decay-iters`` from 400 to 800. megatron-core's scheduler then keeps the checkpoint's
values (``use_checkpoint_opt_param_scheduler``), and the extra 400 steps would run at the
minimum LR without a word. Megatron-LM refuses the mismatch instead unless one of its flags
says which side wins, and so does this module:

* neither flag, schedules equal: resume (nothing to choose);
* neither flag, schedules differ: one line naming each difference, exit status 2;
* ``--use-checkpoint-opt_param-scheduler``: the checkpoint's schedule, whatever the flags say;
* ``--override-opt_param-scheduler``: the flags' schedule, evaluated at the checkpoint's step
  (the LR jumps to where the new schedule is at that step).

The step count always comes from the checkpoint. The choice in force is printed at resume.
"""

from __future__ import annotations

from megatron_ext.errors import UsageError

FLAG_OF = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
           "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
           "wsd_decay_steps": "--lr-wsd-decay-iters",
           "lr_wsd_decay_style": "--lr-wsd-decay-style", "start_wd": "--weight-decay"}
"""Scheduler field -> the flag that sets it (the fields a resume compares)."""

_WSD_FIELDS = ("wsd_decay_steps", "lr_wsd_decay_style")
"""Fields megatron-core's state dict lacks; saved beside it, restored here."""

GROUP_FIELDS = ("max_lr", "min_lr")
"""The schedule's values megatron-core also keeps in every optimizer parameter group (its
scheduler reads them from there, not from itself); a loaded optimizer state brings back the
checkpoint's."""


def group_schedule(optimizer) -> list[dict]:
    """Each parameter group's :data:`GROUP_FIELDS` (those it has), in group order."""
    return [{f: group[f] for f in GROUP_FIELDS if f in group} for group in optimizer.param_groups]


def saved_state(scheduler) -> dict:
    """What a checkpoint stores: megatron's state dict plus the WSD decay fields."""
    return {**scheduler.state_dict(), **{f: getattr(scheduler, f) for f in _WSD_FIELDS}}


def differences(scheduler, saved: dict) -> list[str]:
    """``--flag: X in the checkpoint, Y now`` for each field the two schedules differ in
    (fields an older checkpoint lacks are not compared)."""
    return [f"{flag} {saved[field]} in the checkpoint, {getattr(scheduler, field)} now"
            for field, flag in FLAG_OF.items()
            if field in saved and saved[field] != getattr(scheduler, field)]


def restore(scheduler, saved: dict, flag_groups: list[dict] | None = None) -> str:
    """Load ``saved`` into ``scheduler`` as its construction flags say (see the module
    docstring); ``UsageError`` on an unresolved mismatch. ``flag_groups``: the optimizer's
    :func:`group_schedule` before the checkpoint's optimizer state replaced it (the flags'
    per-group peak / minimum LR, which ``--override-opt_param-scheduler`` puts back).
    Returns the line to print."""
    use_checkpoint = scheduler.use_checkpoint_opt_param_scheduler
    override = scheduler.override_opt_param_scheduler
    diffs = differences(scheduler, saved)
    if diffs and not (use_checkpoint or override):
        raise UsageError("--load: the checkpoint's learning-rate schedule differs from the "
                         f"flags' ({'; '.join(diffs)}): pass "
                         "--use-checkpoint-opt_param-scheduler to keep the checkpoint's, or "
                         "--override-opt_param-scheduler to use the flags'")
    if not override:
        for field in _WSD_FIELDS:
            setattr(scheduler, field, saved.get(field, getattr(scheduler, field)))
    elif flag_groups is not None:
        for group, values in zip(scheduler.optimizer.param_groups, flag_groups):
            group.update(values)
    scheduler.load_state_dict(saved)  # megatron: override -> the flags' values, else saved
    if not diffs:
        source = "the checkpoint's (the flags agree)"
    elif override:
        source = "the flags' (--override-opt_param-scheduler)"
    else:
        source = "the checkpoint's (--use-checkpoint-opt_param-scheduler)"
    return (f"LR schedule: {source}: {scheduler.lr_decay_style} from {scheduler.max_lr:g} to "
            f"{scheduler.min_lr:g}, warm-up {scheduler.lr_warmup_steps}, decay over "
            f"{scheduler.lr_decay_steps} steps; resuming at step {scheduler.num_steps}")
