"""megatron_ext: megatron-core pretraining with adaptive per-layer mixed precision."""

__version__ = "0.1.0"
