"""``--help`` prints no warning: every entry point's help in one fresh Python process (the
dependencies' import-time warnings fire once per process, so the first entry point meets
them all), with Python's default warning filters (no ``PYTHONWARNINGS``) and stderr kept."""

import logging
import os
import subprocess
import sys

from pretrain_runner import REPO

SCRIPTS = ["pretrain_llama.py", "pretrain_gpt.py", *sorted(
    str(p.relative_to(REPO)) for p in [*REPO.glob("tools/*.py"),
                                        REPO / "benchmarks/train_throughput.py"])]

RUN_ALL = """
import runpy, sys
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (0, None), (script, exc.code)
"""


def test_help_prints_no_warning():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-c", RUN_ALL, *SCRIPTS], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("usage:") == len(SCRIPTS)
    assert proc.stderr == ""


def test_only_the_listed_dependency_messages_are_dropped(caplog):
    import warnings

    import megatron_ext  # noqa: F401  (installs the filters)

    logger = logging.getLogger("megatron.core.datasets.gpt_dataset")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Unable to save GPTDataset indexes because path_to_cache is None")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
    caplog.clear()
    blended = logging.getLogger("megatron.core.datasets.blended_dataset")
    with caplog.at_level(logging.WARNING, logger=blended.name):
        blended.warning("Cannot save the BlendedDataset indexes because path_to_cache is None")
    assert caplog.records == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        megatron_ext.silence_dependency_noise()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("Apex is slow", UserWarning)
    assert [str(w.message) for w in caught] == ["Apex is slow"]
