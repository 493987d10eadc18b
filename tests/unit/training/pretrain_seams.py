"""pretrain_llama.py plus a probe extension on the optimizer, stop and train start/end seams."""

import sys

from megatron_ext.defaults import default_extensions
from megatron_ext.extension import Extension
from megatron_ext.training.pretrain import main


def probe(controller) -> Extension:
    calls = {"built": 0, "steps": 0}

    def build_optimizer(args, model, default):
        calls["built"] += 1
        return default(args, model)

    def wrap_optimizer(args, model, optimizer):
        step = optimizer.step

        def counted():
            calls["steps"] += 1
            return step()

        optimizer.step = counted
        return optimizer

    def on_train_start(args, run, state):
        print(f"probe: start at step {state.iteration}", flush=True)

    def on_train_end(args, run, state):
        print(f"probe: end at step {state.iteration}, optimizers built {calls['built']}, "
              f"optimizer steps {calls['steps']}", flush=True)

    return Extension("probe", build_optimizer=build_optimizer, wrap_optimizer=wrap_optimizer,
                     on_train_start=on_train_start, on_train_end=on_train_end,
                     should_stop=lambda args, run, state: state.iteration == 3)


if __name__ == "__main__":
    sys.exit(main("llama", extensions=default_extensions(probe)))
