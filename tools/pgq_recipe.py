#!/usr/bin/env python
"""Make a PGQ recipe from a saved SQNR profile: the per-GEMM PrecisionPlan and its explanation.

    python tools/pgq_recipe.py runs/x/pgq/profile.json --out recipes/fwd20 --pgq-device none
    python tools/pgq_recipe.py runs/x/pgq/profile.json --out recipes/b50 --pgq-format fp4 \
        --pgq-budget 0.5
    python tools/pgq_recipe.py runs/x/pgq/profile.json --out recipes/adv --pgq-adversarial

Writes OUT/recipe.md, OUT/recipe.json and OUT/plan.json (train with --precision-plan
OUT/plan.json). See `python tools/pgq_recipe.py --help` and docs/pgq.md. The code is in
megatron_ext/methods/pgq/ (this file only starts its command line).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.methods.pgq.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
