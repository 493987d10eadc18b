"""A toy precision method in one folder, plugged in through the seams alone (no change to
training/ or precision/): a policy, and an overlay that raises one site to BF16."""

from megatron_ext.extension import Extension
from megatron_ext.precision.policies import Policy, uniform_plan
from megatron_ext.precision.site_formats import SiteFormats

PROMOTED = "L0.fc2"
"""The site the overlay raises."""
HIGH = SiteFormats("bf16", "bf16", "bf16")


def toy_plan(args, arg):
    """FP4 everywhere but layer 1's qkv, which runs FP8."""
    fp4, fp8 = uniform_plan("fp4", args.num_layers), uniform_plan("fp8", args.num_layers)
    return fp4.replace(sites={**fp4.sites, "L1.qkv": fp8.sites["L1.qkv"]}, method="toy")



def toy_extension(controller) -> Extension:
    """``--toy-promote-at STEP``: after that step, raise L0.fc2 to BF16 over any base plan."""

    def add_arguments(parser):
        parser.add_argument_group("toy method").add_argument(
            "--toy-promote-at", type=int, default=0, metavar="STEP",
            help="after this step, raise L0.fc2 to BF16 (0: never)")

    def on_step(args, run, state):
        if state.iteration == args.toy_promote_at:
            controller.set_overlay("toy", "promote", {PROMOTED: HIGH}, rule="raise")
            return {"toy_promoted": PROMOTED}
        return None

    return Extension("toy", add_arguments=add_arguments, on_step=on_step, policies=(
        Policy("toy", toy_plan, help="the toy method's plan", owner="toy"),))
