"""The composition root: every extension a full run has, in hook order.

``pretrain_llama.py`` / ``pretrain_gpt.py`` call ``main(family, extensions=default_extensions())``.
Faults come first (they count a skipped step before methods react to it), the methods next,
the precision platform last. Plan changes do not depend on this order: the platform commits
them in the ``commit_step`` phase, after every extension's ``before_step``, and GNMR's
promotions are derived from the base in force at that commit. A new method adds one line
here.
"""

from __future__ import annotations

from typing import Callable

from megatron_ext.extension import Extension, declared


def default_extensions(*extra: Callable[..., Extension]) -> list[Extension]:
    """Faults, every method, then the ``extra`` ones, then the precision platform. Methods
    are factories ``make(controller) -> Extension`` sharing one plan controller with the
    platform (``extra`` too: a method kept outside the package, a test's); the platform offers
    the ``--precision`` policies they bring (``Extension.policies``) and no others."""
    from megatron_ext.methods.gaussws.extension import gaussws_extension
    from megatron_ext.methods.gnmr.extension import gnmr_extension
    from megatron_ext.methods.pgq.extension import pgq_extension
    from megatron_ext.methods.snip.extension import snip_extension
    from megatron_ext.methods.stquant.extension import stquant_extension
    from megatron_ext.precision.controller import PlanController
    from megatron_ext.precision.extension import PrecisionRun, precision_extension
    from megatron_ext.training.faults import FaultHandler

    controller = PlanController()
    methods = [make(controller) for make in (snip_extension, pgq_extension, stquant_extension,
                                             gaussws_extension, gnmr_extension, *extra)]
    platform = PrecisionRun(controller, declared(methods, "policies"))  # the run's policies
    return [FaultHandler().extension(), *methods, precision_extension(platform)]
