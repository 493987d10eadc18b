"""The hook contract: how features (faults, the precision platform, each method) plug into a run.

A feature is one :class:`Extension`; an entry point passes the list it wants to
``megatron_ext.training.pretrain.main`` (``megatron_ext.defaults.default_extensions()`` is the
full set). Every hook is optional and every per-run hook has the same arguments,
``(args, run, state)``:

* ``args`` — the parsed flags (``argparse.Namespace``);
* ``run`` — the ``TrainingRun`` of this rank: ``model`` (DDP-wrapped chunks), ``optimizer``,
  ``scheduler``, ``datasets``, ``checkpointer`` (``register(name, provider)`` for checkpoint
  state), ``replay(consumed_samples)`` (forward + backward of one global batch with no
  update, for observed passes) and ``step_result`` (the last step's loss, grad norm,
  ``skipped``);
* ``state`` — the ``TrainState`` (``iteration``, ``consumed_samples``).

Hooks run in list order, and before every step in two **phases**: every extension's
``before_step`` (observed passes, proposals: a new base plan, an overlay), then every
extension's ``commit_step`` (the precision platform makes the plan in force of what was
proposed). So a plan change a method makes in ``before_step`` lands at that step, and one
made in ``on_step`` at the next, on every rank, whatever the list order; an overlay that
depends on the base plan is derived from it at the commit (``PlanController.set_overlay(...,
derive=...)``). Extensions never call each other; they share state through the plan
controller of ``megatron_ext.precision`` (base plan, overlays, operand transforms).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_ext.errors import UsageError

Hook = Callable[[argparse.Namespace, Any, Any], Any]
"""``hook(args, run, state)``."""


@dataclass(frozen=True)
class StageTimes:
    """Per-stage times one extension estimates for ``--dry-run`` (the precision platform's,
    from its cost model); the dry run turns them into the step time and tokens/s."""

    seconds: tuple[float, ...]
    """Per pipeline stage: forward + backward of one micro-batch on one GPU."""
    basis: str
    """What they assume, for the summary line (``plan uniform:fp8``)."""
    how: str
    """How they were computed, one phrase for the notes (rates, what is counted)."""


@dataclass(frozen=True)
class DryRunPart:
    """What one extension adds to the ``--dry-run`` report; every field may stay empty."""

    columns: tuple[str, ...] = ()
    """Headers of the stage-table columns it adds (after the parameter counts)."""
    cells: tuple[tuple[str, ...], ...] = ()
    """Per pipeline stage, the text of each of ``columns``."""
    stage_json: tuple[dict, ...] = ()
    """Per pipeline stage, numbers merged into that stage's entry of ``--dry-run-json``."""
    times: StageTimes | None = None
    """Per-stage times; at most one extension of a run gives them (without any, the report
    has no time estimate)."""
    memory: tuple[float, ...] = ()
    """Per pipeline stage, bytes one GPU holds besides the model state and activations
    (added to its total; empty: nothing)."""
    moments: tuple[float, ...] = ()
    """Per pipeline stage, bytes one GPU holds for the optimizer's moments, in place of
    FP32 Adam's ``m`` and ``v`` (8 B/param, sharded like them) in the ``optim`` column; at
    most one part of a run gives them (empty: FP32)."""
    moments_how: str = ""
    """With ``moments``: what they count, one phrase for the memory note (``m, v at 8 bits``)."""
    lines: tuple[str, ...] = ()
    """Summary lines, printed after the time line."""
    notes: tuple[str, ...] = ()
    """Assumptions, one line each (printed as ``note:`` lines)."""
    json: dict = field(default_factory=dict)
    """Top-level keys it adds to ``--dry-run-json`` (no two parts may add the same key)."""


@dataclass(frozen=True)
class Plot:
    """One ``tools/plot_precision.py`` subcommand an extension brings (its figures)."""

    name: str
    """The subcommand (``gnmr``)."""
    help: str
    """One line for ``--help``."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds its inputs and options to the subcommand's parser (the tool adds ``--out``,
    ``--dpi``)."""
    draw: Callable[[argparse.Namespace], Any]
    """``draw(args)`` -> the matplotlib ``Figure``; ``ValueError`` (one line) for bad input."""


@dataclass(frozen=True)
class Conflict:
    """A flag a feature does not run with, declared as data (torchtitan's style) and refused by
    one rule for every feature (:func:`refuse_conflicts`)."""

    flag: str
    """The option string (``--use-torch-fsdp2``); refused when its parsed value is truthy."""
    why: str
    """Why, the end of the one-line message (``it reads megatron DDP's gradient buffers``)."""

    def given(self, args: argparse.Namespace) -> bool:
        """Whether the parsed flags turn ``flag`` on."""
        return bool(getattr(args, self.flag.lstrip("-").replace("-", "_"), False))


FSDP_FLAGS = ("--use-torch-fsdp2", "--use-megatron-fsdp")
"""Training's two FSDP flags (megatron's DDP is the default)."""


def no_fsdp(why: str) -> tuple[Conflict, ...]:
    """The conflicts of a feature that does not run under either FSDP, for ``why``."""
    return tuple(Conflict(flag, why) for flag in FSDP_FLAGS)


@dataclass(frozen=True)
class Extension:
    """Callbacks one feature contributes to a training run."""

    name: str
    """Short name, used in messages and as the owner of its overlays and checkpoint state."""
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    """Adds the feature's flags (its flag group) to the parser."""
    active: Callable[[argparse.Namespace], bool] | None = None
    """``active(args)``: whether the parsed flags switch the feature on (None: always on).
    A flag of its group given while it is off is refused with one line naming the flag and
    ``enabled_by`` (:func:`refuse_inactive_flags`)."""
    enabled_by: str = ""
    """What switches it on, for that line (``--gnmr``, ``--precision snip | ...``)."""
    conflicts: tuple[Conflict, ...] = ()
    """Flags it does not run with while it is on (its config's ``CONFLICTS``): one given is
    refused with one line (:func:`refuse_conflicts`), before any ``validate``."""
    policies: tuple = ()
    """The ``--precision`` policies it brings (``megatron_ext.precision.policies.Policy``):
    a run offers those of its extensions only."""
    optimizers: tuple[tuple[str, str], ...] = ()
    """``(name, help)`` of each ``--optimizer`` choice it builds or wraps (training owns the
    flag; ``adam``, megatron-core's, is always offered)."""
    plots: tuple[Plot, ...] = ()
    """The ``tools/plot_precision.py`` subcommands it brings (its own figures)."""
    validate: Callable[[argparse.Namespace], None] | None = None
    """Checks the parsed flags; raises ``UsageError`` with a one-line message. Runs for the
    dry run too."""
    describe: Callable[[argparse.Namespace], str | None] | None = None
    """``describe(args)`` -> the one start-up line saying the feature is on and with what
    settings (``"snip: on | ..."``), or None when the run does not use it; rank 0 prints it
    after the model line. Called after ``validate``."""
    linear_classes: (Callable[[argparse.Namespace], Callable[[int, str], type] | None]
                     | None) = None
    """Returns ``(global layer, site) -> linear class`` for the layer specs, or None (at most one
    extension of a run returns classes: the precision platform's quantized linear; methods
    change what happens inside it through operand transforms, not through classes)."""
    build_optimizer: Callable[..., Any] | None = None
    """``build_optimizer(args, model, default)`` -> optimizer, or None to leave it to others:
    replaces the optimizer (``default(args, model)`` builds megatron's). At most one extension
    of a run may return one (torchtitan's ``build_optimizers_fn``)."""
    wrap_optimizer: Callable[..., Any] | None = None
    """``wrap_optimizer(args, model, optimizer)`` -> optimizer: runs after the optimizer is
    built, in list order (torchtitan's ``post_optimizer_hook``)."""
    after_model: Callable[[argparse.Namespace, list], None] | None = None
    """``after_model(args, chunks)``: the model chunks are built, initialised and on their
    device, not yet wrapped in DDP: a method that adds parameters to the model (GaussWS's
    per-tile bit widths) adds them here, so DDP's gradient buffers, the gradient norm, the
    optimizer and the checkpoints all see them. Runs in list order (not in ``--dry-run``,
    which counts megatron's own parameters)."""
    after_setup: Hook | None = None
    """After the model, optimizer and checkpointer exist, before ``--load``: register
    checkpoint state, apply the first plan."""
    before_step: Hook | None = None
    """Before each optimizer step, first phase: observed passes, proposed plan switches."""
    commit_step: Hook | None = None
    """Before each optimizer step, second phase, after every extension's ``before_step``:
    make what they proposed take effect (the precision platform commits the plan)."""
    on_step: Callable[..., dict | None] | None = None
    """After each optimizer step (``run.step_result`` holds its result); a returned dict is
    merged into that step's metrics record. ``run.step_result["logged"]`` says whether that
    record is written (the same on every rank): metrics that cost time may be left out of the
    others. What an unlogged step returns goes into the next logged record (later steps' values
    win), so an event (a refresh, a profile) is never dropped."""
    on_nonfinite: Callable[..., dict | None] | None = None
    """On every rank after a step whose loss or gradients were not finite (its update was
    skipped, ``state.iteration`` is that step), before ``on_step``: the place to move offending
    sites to high precision. A returned dict is merged into the step's metrics."""
    should_stop: Callable[..., bool] | None = None
    """After each step, on every rank (it may be collective): True saves a checkpoint and stops
    the run cleanly; raising ``UsageError`` stops it with one line and no checkpoint."""
    on_train_start: Hook | None = None
    """Training begins (after ``--load``): install signal handlers, hooks."""
    on_train_end: Hook | None = None
    """Training ended, normally or not: undo what ``on_train_start`` did."""
    dry_run_estimate: Callable[..., DryRunPart | None] | None = None
    """``dry_run_estimate(args, context)`` -> the :class:`DryRunPart` (columns, lines, times,
    JSON) the feature adds to ``--dry-run``'s report, or None; ``context`` is the dry run's
    ``megatron_ext.training.dry_run.parts.DryRunContext`` (layout, the stages megatron built,
    padded vocabulary). Runs after ``validate``, in list order."""


def args_provider(extensions: list[Extension]):
    """Megatron-LM style ``extra_args_provider`` adding every extension's flags."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for ext in extensions:
            if ext.add_arguments is not None:
                ext.add_arguments(parser)
        return parser

    return provide


def flag_groups(extensions: list[Extension]) -> dict[str, list[argparse.Action]]:
    """Extension name -> the flags (argparse actions) its ``add_arguments`` adds."""
    groups = {}
    for e in extensions:
        if e.add_arguments is not None:
            parser = argparse.ArgumentParser(add_help=False)
            e.add_arguments(parser)
            groups[e.name] = list(parser._actions)
    return groups


def flag_options(extensions: list[Extension]) -> list[str]:
    """Every option string of the extensions' flag groups."""
    return [o for actions in flag_groups(extensions).values() for a in actions
            for o in a.option_strings]


def refuse_inactive_flags(extensions: list[Extension], args: argparse.Namespace,
                          given: set[str]) -> None:
    """``UsageError`` naming the first flag in ``given`` (option strings the command line
    holds) whose extension is off, and what switches that extension on."""
    groups = flag_groups(extensions)
    for e in extensions:
        if e.active is None or e.active(args):
            continue
        for action in groups.get(e.name, ()):
            flag = next((o for o in action.option_strings if o in given), None)
            if flag is not None:
                raise UsageError(f"{flag} is a flag of {e.name}, which is off: it needs "
                                 f"{e.enabled_by or 'its switch'}")


def refuse_conflicts(extensions: list[Extension], args: argparse.Namespace) -> None:
    """``UsageError`` for the first declared :class:`Conflict` of an extension that is on whose
    flag the parsed flags turn on."""
    for e in extensions:
        if e.active is not None and not e.active(args):
            continue
        for conflict in e.conflicts:
            if conflict.given(args):
                raise UsageError(f"{e.name} does not run with {conflict.flag}: {conflict.why}")


def declared(extensions: list[Extension], name: str) -> list:
    """Everything the extensions declare in their tuple field ``name`` (``policies``,
    ``optimizers``, ``plots``), in list order."""
    return [item for e in extensions for item in getattr(e, name)]


def hooks(extensions: list[Extension], name: str) -> list[Callable]:
    """The extensions' ``name`` hooks, in list order."""
    return [getattr(e, name) for e in extensions if getattr(e, name) is not None]


def the_one(extensions: list[Extension], name: str, *call_args) -> Any:
    """Call every extension's ``name`` hook; the one non-None answer, or None. ``ValueError``
    if two extensions answer (two optimizers, two linear-class maps)."""
    answers = [(e.name, hook(*call_args)) for e in extensions
               if (hook := getattr(e, name)) is not None]
    answers = [(who, value) for who, value in answers if value is not None]
    if len(answers) > 1:
        raise ValueError(f"several extensions provide {name}: "
                         f"{', '.join(who for who, _ in answers)}")
    return answers[0][1] if answers else None
