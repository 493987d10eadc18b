"""GaussWS beside DiffQ, the paper's baseline, on the tiny Llama on CPU (not a test): whole
training-step time and the extra bytes per parameter each keeps.

    nice -n 10 python benchmarks/gaussws_vs_diffq.py --rounds 3 --train-iters 25 --skip 5

Runs (:func:`train_runs`), interleaved per round through ``gaussws_overhead.py``'s
``--train`` machinery (:func:`gaussws_overhead.train_step_times`: a child process per run,
one thread, the medians of each run's step CPU and wall time, then over rounds, ratios to
``plain``): ``plain``; ``--gaussws od`` / ``all`` with the eq. 10 bit-width loss on
(``--gaussws-lambda``); DiffQ over the same sites' weights (``od`` = proj + fc2, ``all`` =
every linear) with its size loss on.

**DiffQ in a megatron run** (:func:`diffq_extension`). ``diffq.DiffQuantizer(model)`` hooks
the model's forward: before each training forward it replaces every quantized parameter ``p``
*by name* in its module's ``_parameters`` with ``p + scale · 1/(2^b - 1) · U(-1/2, 1/2)``
(fresh noise every forward; ``scale = max p - min p`` over the whole tensor; ``b`` per group of
``group_size`` consecutive elements, from a learned logit) and puts ``p`` back after the
forward. The noise is uniform as in the GaussWS paper's DiffQ (``--diffq-noise gaussian``:
N(0, 1)/2, the library's default). Megatron's ``ColumnParallelLinear`` /
``RowParallelLinear`` read ``self.weight`` in their forward, so this works on them unchanged;
the quantizer is built in ``after_model`` over each model chunk with
every parameter but the chosen sites' weights excluded (:func:`diffq_exclude`, DiffQ's
``exclude`` patterns), so its logits (``...linear_fc2.weight_diffq``) are model parameters
before DDP and megatron's optimizer trains them (1-D: no weight decay; at the run's learning
rate, where DiffQ's ``setup_optimizer`` would use 1e-3). The size loss of DiffQ's README,
``penalty · quantizer.model_size()`` (MB, differentiable in the logits), is added as its
gradient (times the loss scale) to the logits' reduced gradients before the optimizer step,
the way GaussWS adds eq. 10. TP = 1 only (DiffQ's scale is the local shard's).

Bytes per parameter (:func:`bytes_table`, at each site shape): ``saved`` is what autograd keeps
for the backward beyond x, w and the bit parameters (``gaussws_overhead.saved_bytes``): GaussWS
as wired keeps ŵ (``sample``), DiffQ keeps the noisy weight and its noise draw; ``state`` is
the bit parameters with their gradient and two AdamW moments (float32).

DiffQ (``pip install --no-deps diffq==0.2.4``: an sdist that compiles a Cython extension,
CC-BY-NC licence) is optional: without it the DiffQ runs are left out, with one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gaussws_overhead import (CHILD, SITES, measure_site, pretrain_child, saved_bytes,
                              train_step_times)  # noqa: E402

from megatron_ext.errors import UsageError, run_cli  # noqa: E402
from megatron_ext.extension import Extension  # noqa: E402
from megatron_ext.io import write_json_atomic  # noqa: E402
from megatron_ext.methods.gaussws.flags import SITE_GROUPS  # noqa: E402
from megatron_ext.precision.recipe_export import MODULES  # noqa: E402

LAMBDA = "1e-4"
"""Weight of each method's bit-width / size loss in the timed runs (the GaussWS paper's λ)."""


def diffq_available() -> bool:
    """Whether ``diffq`` (and its compiled ``bitpack``) can be imported."""
    try:
        import diffq  # noqa: F401
    except ImportError:
        return False
    return True


def train_runs(group_size: int, with_diffq: bool) -> dict[str, list[str]]:
    """Run name -> flags on top of the tiny Llama's defaults (module docstring)."""
    runs = {"plain": []}
    for group in ("od", "all"):
        runs[f"gaussws-{group}"] = ["--gaussws", group, "--gaussws-lambda", LAMBDA]
    if with_diffq:
        for group in ("od", "all"):
            runs[f"diffq-{group}"] = ["--diffq", group, "--diffq-group-size", str(group_size),
                                      "--diffq-penalty", LAMBDA]
    return runs


def diffq_exclude(model: torch.nn.Module, sites) -> list[str]:
    """Every parameter of ``model`` but the weights of ``sites`` (names of the tiny Llama's
    linears), spelt as ``DiffQuantizer`` matches its ``exclude`` patterns: module path, dot,
    parameter name."""
    keep = tuple(f".{MODULES[s]}.weight" for s in sites)
    return [f"{mname}.{pname}" for mname, module in model.named_modules()
            for pname, _ in module.named_parameters(recurse=False)
            if not f"{mname}.{pname}".endswith(keep)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--diffq*`` flags of a child run."""
    g = parser.add_argument_group("DiffQ (benchmark baseline)")
    g.add_argument("--diffq", default=None, choices=sorted(SITE_GROUPS),
                   help="DiffQ noise on these sites' weights: od (proj, fc2) or all")
    g.add_argument("--diffq-group-size", type=int, default=1024,
                   help="weights sharing one learned bit width (default 1024 = a 32x32 tile)")
    g.add_argument("--diffq-noise", default="uniform", choices=("uniform", "gaussian"),
                   help="DiffQ's noise: uniform U(-1/2, 1/2) (default; the GaussWS paper's "
                        "DiffQ) or gaussian N(0, 1)/2 (the diffq library's default)")
    g.add_argument("--diffq-penalty", type=float, default=0.0,
                   help="weight of the size loss penalty * model_size() in MB (default 0: off)")


def diffq_extension(controller) -> Extension:
    """DiffQ on a megatron run (module docstring); ``controller`` is unused (no plan)."""
    quantizers = []

    def validate(args):
        if args.diffq is not None and not diffq_available():
            raise UsageError("--diffq: diffq is not installed (pip install --no-deps "
                             "diffq==0.2.4)")
        if args.diffq is not None and args.tensor_model_parallel_size != 1:
            raise UsageError("--diffq: tensor parallelism is not supported (TP = 1 only)")

    def after_model(args, chunks):
        if args.diffq is None:
            return
        from diffq import DiffQuantizer

        for chunk in chunks:
            exclude = diffq_exclude(chunk, SITE_GROUPS[args.diffq])
            q = DiffQuantizer(chunk, min_size=0, group_size=args.diffq_group_size,
                              noise=args.diffq_noise, exclude=exclude)
            q.no_optimizer()  # the logits are model parameters: megatron's optimizer has them
            quantizers.append(q)

    def wrap_optimizer(args, model, optimizer):
        if args.diffq is None or args.diffq_penalty == 0:
            return optimizer
        step = optimizer.step

        def step_with_size_loss(*a, **kw):
            logits = [p for q in quantizers for n, p in q.model.named_parameters()
                      if n.endswith(q.suffix)]
            size = sum(q.model_size() for q in quantizers)
            scale = optimizer.get_loss_scale()  # as GaussWS's: no host synchronisation
            for p, g in zip(logits, torch.autograd.grad(args.diffq_penalty * size, logits)):
                (p.main_grad if hasattr(p, "main_grad") else p.grad).add_(g * scale)
            return step(*a, **kw)

        optimizer.step = step_with_size_loss
        return optimizer

    return Extension("diffq", add_arguments=add_arguments, validate=validate,
                     after_model=after_model, wrap_optimizer=wrap_optimizer)


def diffq_site_bytes(out_f: int, in_f: int, group_size: int, tokens: int) -> dict:
    """DiffQ on one ``out_f x in_f`` linear: bytes per parameter autograd keeps beyond x, w
    and the logits, and the logits' float32 state (value, gradient, two AdamW moments)."""
    from diffq import DiffQuantizer

    lin = torch.nn.Linear(in_f, out_f, bias=False)
    q = DiffQuantizer(lin, min_size=0, group_size=group_size, noise="uniform")
    q.no_optimizer()
    x = torch.randn(tokens, in_f, requires_grad=True)
    params = out_f * in_f
    return {"saved": saved_bytes(lambda: lin(x), (x, lin.weight, lin.weight_diffq)) / params,
            "state": lin.weight_diffq.numel() * 4 * 4 / params}


def bytes_table(group_size: int, with_diffq: bool, tokens: int = 128) -> dict:
    """Site -> method -> {saved, state} bytes per parameter (module docstring)."""
    table = {}
    for site, (out_f, in_f) in SITES.items():
        g = measure_site(out_f, in_f, argparse.Namespace(tokens=tokens, repeats=1))
        table[site] = {"gaussws": {"saved": g["sample_saved_B_per_param"],
                                   "state": g["state_B_per_param"]}}
        if with_diffq:
            table[site]["diffq"] = diffq_site_bytes(out_f, in_f, group_size, tokens)
    return table


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--train-iters", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--skip", type=int, default=5,
                   help="warm-up steps left out of a run's median (default 5)")
    p.add_argument("--group-size", type=int, default=1024,
                   help="DiffQ's weights per learned bit width (default 1024 = a 32x32 tile, "
                        "GaussWS's)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if min(args.rounds, args.group_size) < 1:
        raise UsageError("--rounds and --group-size must be positive")
    if not 0 <= args.skip < args.train_iters:
        raise UsageError("--skip must be in [0, --train-iters)")
    return args


def run(argv) -> None:
    args = parse_args(argv)
    with_diffq = diffq_available()
    if not with_diffq:
        print("diffq is not installed (pip install --no-deps diffq==0.2.4): DiffQ left out")
    table = bytes_table(args.group_size, with_diffq)
    print("bytes per parameter: saved for the backward (beyond x, w, bits) / bit state")
    for site, methods in table.items():
        print(f"{site:5}" + "".join(f"  {m} {b['saved']:.3f} / {b['state']:.4f}"
                                    for m, b in methods.items()))
    times = train_step_times(args, train_runs(args.group_size, with_diffq), __file__)
    if args.json:
        write_json_atomic(args.json, {"args": vars(args), "bytes_per_param": table,
                                      "step_time_s": times})


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:  # one timed run
        raise SystemExit(pretrain_child(diffq_extension))
    raise SystemExit(run_cli(run))
