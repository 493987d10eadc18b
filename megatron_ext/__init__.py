"""megatron_ext: megatron-core pretraining with adaptive per-layer mixed precision."""

from megatron_ext.checkout import warn_other_checkouts
from megatron_ext.quiet import silence_dependency_noise

__version__ = "0.1.0"

# Every process that imports megatron-core through this package -- the trainer, every tool,
# and the checkpoint writer's helper process, which re-imports the entry point -- imports
# this file first, so dependency noise is silenced in each of them before it can appear.
silence_dependency_noise()
warn_other_checkouts()  # PYTHONPATH naming another checkout does not make it the one that runs
