#!/usr/bin/env python
"""Plot precision plans, their evolution over SNIP refreshes, divergences and loss curves.

    python tools/plot_precision.py plan plan.json --out plan.png
    python tools/plot_precision.py stages plan.json --pipeline-model-parallel-size 2 \
        --out stages.png
    python tools/plot_precision.py evolution runs/x --out evolution.png
    python tools/plot_precision.py divergence runs/x/snip/step_000100/divergence.json --out div.png
    python tools/plot_precision.py loss runs/a runs/b --labels fp8,snip --out loss.png
    python tools/plot_precision.py gaussws runs/x --out bits.png

See `python tools/plot_precision.py <command> --help` for every flag, docs/plots.md for the
inputs. The code is in megatron_ext/viz/ and each method's plots.py; the subcommands are
those the extensions bring (megatron_ext.defaults.plot_main).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.defaults import plot_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
