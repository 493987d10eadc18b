"""The composition root: every extension a full run has, in hook order.

``pretrain_llama.py`` / ``pretrain_gpt.py`` call ``main(family, extensions=default_extensions())``.
Faults come first (they count a skipped step before methods react to it), the methods next,
the precision platform last. Plan changes do not depend on this order: the platform commits
them in the ``commit_step`` phase, after every extension's ``before_step``, and GNMR's
promotions are derived from the base in force at that commit. A new method adds one line
here.
"""

from __future__ import annotations

import importlib
from typing import Callable

from megatron_ext.extension import Extension, declared

METHODS = ("snip", "pgq", "stquant", "gaussws", "gnmr")
"""Every method of the package, in hook order: ``megatron_ext/methods/<name>/`` has
``extension.py`` with ``<name>_extension(controller)``, the factory of its Extension (its
flags, policies, plots, hooks)."""


def _module(method: str, module: str):
    return importlib.import_module(f"megatron_ext.methods.{method}.{module}")


def default_extensions(*extra: Callable[..., Extension]) -> list[Extension]:
    """Faults, every method, then the ``extra`` ones, then the precision platform. Methods
    are factories ``make(controller) -> Extension`` sharing one plan controller with the
    platform (``extra`` too: a method kept outside the package, a test's); the platform offers
    the ``--precision`` policies they bring (``Extension.policies``) and no others."""
    from megatron_ext.precision.controller import PlanController
    from megatron_ext.precision.extension import PrecisionRun, precision_extension
    from megatron_ext.training.faults import FaultHandler

    controller = PlanController()
    makers = [getattr(_module(m, "extension"), f"{m}_extension") for m in METHODS]
    methods = [make(controller) for make in (*makers, *extra)]
    platform = PrecisionRun(controller, declared(methods, "policies"))  # the run's policies
    return [FaultHandler().extension(), *methods, precision_extension(platform)]


def plot_main(argv: list[str] | None = None, *extra: Callable[..., Extension]) -> int:
    """``tools/plot_precision.py``: the platform's plots and those the extensions of a full
    run (with ``extra``) bring (``Extension.plots``); a method without plots has no
    subcommand (``invalid choice``, one line)."""
    from megatron_ext.viz.cli import main

    return main(argv, plots=declared(default_extensions(*extra), "plots"))
