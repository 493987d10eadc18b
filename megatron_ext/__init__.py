"""megatron_ext: megatron-core pretraining with adaptive per-layer mixed precision."""

import warnings

__version__ = "0.1.0"

# megatron-core warns at import (four modules, 8 lines) that Transformer Engine and Apex are
# missing, which a CPU run never uses. Every process that imports megatron-core through this
# package -- the trainer, every tool, and the checkpoint writer's helper process, which
# re-imports the entry point -- imports this file first, so the filter is set in each of them.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed",
                        category=UserWarning)
