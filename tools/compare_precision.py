#!/usr/bin/env python
"""Compare precision runs: train a grid of runs x seeds, then tables and plots of the losses.

    python tools/compare_precision.py --config examples/compare/snip_grid.yaml \
        --out runs/snip_grid --jobs 2
    python tools/compare_precision.py --out runs/cmp --seeds 1,2,3 --reference fp32 \
        --base-flags="--train-iters 200" --run fp32= --run fp4="--precision uniform:fp4"
    python tools/compare_precision.py --config grid.yaml --out runs/x --dry-run

See `python tools/compare_precision.py --help` for every flag, docs/compare.md for the config
format and the outputs. The code is in megatron_ext/compare/ (this file only starts it).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.compare.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
