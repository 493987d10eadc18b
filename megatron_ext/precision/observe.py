"""Observed passes: run the training schedule on a batch with observers in place of the GEMMs.

A method that measures something about every site (SNIP's statistics and noise probes, PGQ's
SQNR profile) attaches an **observer** to each quantized linear: a callable
``observer(module, input, weight, kwargs) -> output`` that the linear calls *instead of* its
GEMM (:class:`~megatron_ext.precision.layers.QuantizedLinear`), so it sees every operand of
fprop and — through its own autograd function — of dgrad and wgrad. It then replays a batch
through megatron's real pipeline schedule with no optimizer step
(``run.replay(consumed_samples)``, provided by training) and detaches the observers.

The torch RNG is forked for the pass and seeded from the batch, so stochastic-rounding draws
inside the pass neither depend on, nor shift, training's own stream: the step that follows is
exactly the step it would have been.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from megatron.core import tensor_parallel

from megatron_ext.precision.layers import quantized_linears

Observer = Callable[..., torch.Tensor]
"""``observer(module, input, weight, kwargs) -> output``, run instead of the site's GEMM."""


@contextmanager
def observing(model, observers: dict[str, Observer]):
    """Attach ``observers`` (site id -> observer) to ``model``'s quantized linears for the
    ``with`` block; always detached after, also on error."""
    linears = quantized_linears(model)
    try:
        for sid, observer in observers.items():
            linears[sid].observer = observer
        yield linears
    finally:
        for sid in observers:
            linears[sid].observer = None


@contextmanager
def isolated_rng(seed: int):
    """A forked torch RNG (CPU and the current GPU), seeded with ``seed``, for the block; and
    megatron's model-parallel RNG tracker (dropout inside TP regions draws from it) put back as
    it was, so an observed pass leaves the run's random streams untouched."""
    gpus = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = tracker.get_states() if tracker.is_initialized() else None
    try:
        with torch.random.fork_rng(devices=gpus):
            torch.manual_seed(seed)
            yield
    finally:
        if saved is not None:  # fork() replaces a state's tensor: the saved ones are intact
            tracker.set_states(saved)


def observed_pass(run, observers: dict[str, Observer], consumed_samples: int,
                  seed: int) -> float:
    """One replay of the batch at ``consumed_samples`` with ``observers`` attached; its loss."""
    with isolated_rng(seed), observing(run.model, observers):
        return run.replay(consumed_samples)
