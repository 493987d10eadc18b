"""Dependency messages that look like errors but are not, silenced in every process.

``megatron_ext/__init__.py`` calls :func:`silence_dependency_noise` before anything imports
megatron-core, torch's checkpointing or torchao, so it covers import-time warnings too, in
the trainer, every tool and the checkpoint writer's helper processes (which re-import the
entry point). Only the messages listed here are dropped; any other warning still shows once
per place, as Python's default.
"""

import logging
import warnings

IGNORED_WARNINGS = (
    # megatron-core at import: GPU libraries a CPU run (and --help) never uses
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed"),
    # torch, on every --load: APIs megatron-core's dist_checkpointing still calls
    (FutureWarning, r"`load_state_dict` is deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)
"""(category, start of the message as a regex) of the warnings never shown."""

IGNORED_LOG_RECORDS = {
    # mock data and blends have no index cache by design (docs/data.md)
    "megatron.core.datasets.gpt_dataset": ("Unable to save",),
    "megatron.core.datasets.blended_dataset": ("Cannot save",),
    # torchao (imported by transformers in convert verify) and torch's notes about it:
    # CUDA kernels that cannot load on a CPU machine, an API torchao still calls
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("%s is an Enum subclass",),
}
"""Logger name -> starts of the (unformatted) messages dropped from it."""


class _DropPrefixes(logging.Filter):
    """Drops the records whose unformatted message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def silence_dependency_noise() -> None:
    """Install the warning filters and logging filters above (idempotent)."""
    for category, message in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, prefixes in IGNORED_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(prefixes))
