"""pretrain_llama.py plus an outside method that replaces the base plan: before step
``--probe-switch-at + 1`` it sets the base to uniform FP4 (issue 24's reproduction). It is
appended after every method of ``default_extensions``, GNMR included."""

import sys

from megatron_ext.defaults import default_extensions
from megatron_ext.extension import Extension
from megatron_ext.precision.policies import uniform_plan
from megatron_ext.training.pretrain import main


def base_switch(controller) -> Extension:
    def before_step(args, run, state):
        if state.iteration == 2:  # before step 3
            controller.set_base(uniform_plan("fp4", args.num_layers))

    return Extension("base-switch", before_step=before_step)


if __name__ == "__main__":
    sys.exit(main("llama", extensions=default_extensions(base_switch)))
