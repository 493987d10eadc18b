"""Cost of GaussWS on one linear layer on CPU (not a test): forward + backward time of the
sampled linear against the plain linear at the tiny Llama's four site shapes, and the extra
bytes per parameter.

    nice -n 19 python benchmarks/gaussws_overhead.py
    nice -n 19 python benchmarks/gaussws_overhead.py --tokens 128 --repeats 50 --json out.json
    nice -n 19 python benchmarks/gaussws_overhead.py --train      # whole training steps

``--train`` times whole training steps instead: the tiny Llama on the embedded corpus without
GaussWS, with ``--gaussws od`` and with ``--gaussws all`` (:data:`TRAIN_RUNS`), one thread,
``--rounds`` rounds interleaved; per run the median after ``--skip`` warm-up steps of the
step's CPU time (:func:`cpu_timer`: the work, robust to other jobs on a shared machine) and of
its wall time (``step_time_s``), and its fastest step's CPU time (on a heavily shared machine
contention inflates CPU time too; the minimum is the stable statistic), then the median over
rounds and the ratio to the plain run.

Variants per site, timed interleaved in one run (so load from other jobs hits all alike),
the fastest of ``--repeats`` rounds (on a shared machine the minimum is the stable
statistic; the median is written to the JSON too), each a full forward + backward with
``x``, ``w`` and the bit widths requiring gradients:

* ``plain``   — ``F.linear(x, w)``;
* ``sample``  — ``F.linear(x, GaussSample(w))``: ŵ is a new tensor autograd keeps for dgrad;
* ``regen``   — the wired route: :func:`recomputable_sample` through the quantized GEMM
  (no plan), which keeps w and rebuilds ŵ in the backward from the key;
* ``defer``   — ``sample`` with the bit widths' gradient deferred to once per step
  (``GaussWSWeight(defer_bits_grad=True)``): R is generated in the forward only. The
  per-step pass (:meth:`GaussWSWeight.accumulate_bits_grad`) is timed apart (``step``).

The sampled variants include the tile maxima, R's generation and (but ``defer``) its
regeneration and eq. 3 in the backward (``regen`` also rebuilds ŵ there). Bytes: ``saved``
is what autograd keeps beyond the existing x, w and bias (measured with saved-tensor
hooks); ``state`` is b_i with its gradient and two AdamW moments (float32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_ext.errors import UsageError, run_cli
from megatron_ext.extension import Extension
from megatron_ext.io import write_json_atomic
from megatron_ext.methods.gaussws import (
    GaussSample,
    GaussWSConfig,
    GaussWSWeight,
    ShardLayout,
    local_block_amax,
    recomputable_sample,
)
from megatron_ext.precision.gemm import quantized_gemm
from megatron_ext.precision.site_formats import SiteFormats, resolve

SITES = {"qkv": (256, 128), "proj": (128, 128), "fc1": (704, 128), "fc2": (128, 352)}
"""(out, in) features of the tiny Llama's sites (hidden 128, 4 heads in 2 groups, FFN 352,
SwiGLU fc1 fused)."""
KEY = 20240607
PASSTHROUGH = resolve(SiteFormats())
"""The quantized GEMM's operands with no plan (megatron's GEMM)."""


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512,
                   help="tokens per micro-batch (rows of x; default 512 = 4 x 128)")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds (default 30)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--train", action="store_true",
                   help="time whole training steps with --gaussws od / all vs without")
    p.add_argument("--train-iters", type=int, default=30,
                   help="steps per training run with --train (default 30)")
    p.add_argument("--skip", type=int, default=5,
                   help="warm-up steps left out of a run's median with --train (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of the runs with --train (default 3)")
    args = p.parse_args(argv)
    if min(args.tokens, args.repeats, args.threads, args.rounds) < 1:
        raise UsageError("--tokens, --repeats, --threads and --rounds must be positive")
    if not 0 <= args.skip < args.train_iters:
        raise UsageError("--skip must be in [0, --train-iters)")
    return args


def _variants(out_f: int, in_f: int, tokens: int):
    """name -> (run(): forward output, inputs that already exist)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_f, generator=gen, requires_grad=True)
    w = torch.randn(out_f, in_f, generator=gen, requires_grad=True)
    layout = ShardLayout.full(out_f, in_f)
    bits = torch.full(layout.grid_shape, 6.0, requires_grad=True)

    def sample():
        amax = local_block_amax(w, layout)
        return torch.nn.functional.linear(x, GaussSample.apply(w, bits, amax, KEY, layout))

    def regen():
        return quantized_gemm(x, recomputable_sample(w, bits, KEY, layout), None, PASSTHROUGH)

    def defer():
        amax = local_block_amax(w, layout)
        w_hat = GaussSample.apply(w, bits.detach(), amax, KEY, layout)
        return torch.nn.functional.linear(x, w_hat)

    runs = {"plain": lambda: torch.nn.functional.linear(x, w), "sample": sample, "regen": regen,
            "defer": defer}
    return runs, (x, w, bits), torch.randn(tokens, out_f, generator=gen)


def _step_pass(out_f: int, in_f: int):
    """The once-per-step eq. 3 pass of ``defer`` (returns a callable that times it)."""
    mod = GaussWSWeight(ShardLayout.full(out_f, in_f), GaussWSConfig(("fc2",)))
    w, w_grad = torch.randn(out_f, in_f), torch.randn(out_f, in_f)

    def run():
        start = time.perf_counter()
        mod.accumulate_bits_grad(w, w_grad, KEY)
        return time.perf_counter() - start

    return run


def _time(run, dy) -> float:
    start = time.perf_counter()
    run().backward(dy)
    return time.perf_counter() - start


def saved_bytes(run, existing) -> int:
    """Bytes autograd keeps for ``run()``'s backward beyond the tensors in ``existing``."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        run()
    owned = {t.untyped_storage().data_ptr() for t in existing}
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                if t.untyped_storage().data_ptr() not in owned}.values())


def measure_site(out_f: int, in_f: int, args) -> dict:
    runs, existing, dy = _variants(out_f, in_f, args.tokens)
    timers = {name: (lambda run=run: _time(run, dy)) for name, run in runs.items()}
    timers["step"] = _step_pass(out_f, in_f)
    times = {name: [] for name in timers}
    for i in range(3 + args.repeats):  # 3 warm-up rounds
        for name, timer in timers.items():
            elapsed = timer()
            if i >= 3:
                times[name].append(elapsed)
    params = out_f * in_f
    tiles = existing[2].numel()
    result = {name: min(t) * 1e3 for name, t in times.items()}
    result.update({f"{name}_median": statistics.median(t) * 1e3 for name, t in times.items()})
    result.update({f"{name}_ratio": result[name] / result["plain"]
                   for name in ("sample", "regen", "defer")})
    result.update({f"{name}_saved_B_per_param": saved_bytes(run, existing) / params
                   for name, run in runs.items() if name != "plain"})
    result["state_B_per_param"] = tiles * 4 * 4 / params
    return result


TRAIN_RUNS = {"plain": [], "od": ["--gaussws", "od"], "all": ["--gaussws", "all"]}
"""The ``--train`` runs: flags on top of the tiny Llama's defaults."""
CHILD = "--pretrain-child"
"""First argument of this script when it is one ``--train`` run (a child process)."""


def cpu_timer(controller) -> Extension:
    """Adds ``step_cpu_s`` to every step's metrics: this process's CPU seconds from its
    ``before_step`` to its ``on_step`` (one thread: the work done, however loaded the machine)."""
    start = [0.0]

    def before_step(args, run, state):
        start[0] = time.process_time()

    def on_step(args, run, state):
        return {"step_cpu_s": time.process_time() - start[0]}

    return Extension("cpu_timer", before_step=before_step, on_step=on_step)


def _train_once(run_dir: Path, flags: list[str], skip: int, script: str) -> dict[str, float]:
    """One ``--train`` run in a child process (``script`` with :data:`CHILD`): medians of step
    CPU and wall time (s), and the fastest step's CPU time (``step_cpu_min_s``: the statistic
    least moved by other jobs)."""
    cmd = [sys.executable, str(Path(script).resolve()), CHILD, "--no-save", "--run-dir",
           str(run_dir), "--log-interval", "1", "--eval-iters", "0", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        steps = [r for r in map(json.loads, f) if "step_cpu_s" in r and r["step"] > skip]
    times = {key: statistics.median(r[key] for r in steps)
             for key in ("step_cpu_s", "step_time_s")}
    return {**times, "step_cpu_min_s": min(r["step_cpu_s"] for r in steps)}


def train_step_times(args, runs: dict[str, list[str]] = TRAIN_RUNS, script: str = __file__,
                     model: str = "tiny Llama, embedded corpus") -> dict:
    """``--train``: run -> per round, the medians of step CPU and wall time (module docstring).
    ``runs``: name -> flags (one named ``plain``, the base of the ratios); ``script`` runs
    each as a child (its ``__main__`` calls :func:`pretrain_child` after :data:`CHILD`);
    ``model`` names the runs' model in the printed header."""
    common = ["--train-iters", str(args.train_iters), "--seed", "1234"]
    results = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, flags in runs.items():
                results[name].append(_train_once(Path(tmp) / f"{name}-{round_}",
                                                 [*common, *flags], args.skip, script))
    keys = ("step_cpu_s", "step_time_s", "step_cpu_min_s")
    base = {k: statistics.median(r[k] for r in results["plain"]) for k in keys}
    print(f"{model}, one thread, steps {args.skip + 1}-{args.train_iters}, "
          f"{args.rounds} rounds: median over rounds of each run's median step")
    w = max(map(len, runs)) + 1
    print(f"{'run':<{w}}{'CPU ms':>8}{'x plain':>9}{'wall ms':>9}{'x plain':>9}{'min CPU':>9}"
          f"{'x plain':>9}   CPU ms per round")
    for name, rounds in results.items():
        cpu, wall, fast = (statistics.median(r[k] for r in rounds) for k in keys)
        print(f"{name:<{w}}{1e3 * cpu:8.1f}{cpu / base['step_cpu_s']:9.3f}{1e3 * wall:9.1f}"
              f"{wall / base['step_time_s']:9.3f}{1e3 * fast:9.1f}"
              f"{fast / base['step_cpu_min_s']:9.3f}   "
              + " ".join(f"{1e3 * r['step_cpu_s']:.1f}" for r in rounds), flush=True)
    return results


def run(argv) -> None:
    args = parse_args(argv)
    if args.train:
        medians = train_step_times(args)
        if args.json:
            write_json_atomic(args.json, {"args": vars(args), "step_time_s": medians})
        return
    torch.set_num_threads(args.threads)
    results = {site: measure_site(*shape, args) for site, shape in SITES.items()}
    print(f"tokens {args.tokens}, {args.repeats} rounds, {args.threads} thread(s); ms per "
          "forward+backward (fastest round), ratio to plain; bytes per parameter")
    names = ("plain", "sample", "regen", "defer", "step")
    print(f"{'site':5}" + "".join(f"{n:>8}" for n in names) + "  x sample  x regen  x defer"
          "  saved(sample) saved(regen) state")
    for site, r in results.items():
        print(f"{site:5}" + "".join(f"{r[n]:8.3f}" for n in names)
              + "".join(f"{r[f'{n}_ratio']:9.2f}" for n in ("sample", "regen", "defer"))
              + f"{r['sample_saved_B_per_param']:15.3f}{r['regen_saved_B_per_param']:13.4f}"
              f"{r['state_B_per_param']:7.4f}")
    for group, sites in (("od", ("proj", "fc2")), ("all", tuple(SITES))):
        plain = sum(results[s]["plain"] for s in sites)
        ratios = {n: sum(results[s][n] for s in sites) / plain for n in ("regen", "defer")}
        print(f"[{group}] sampled sites' linear time / plain: regen {ratios['regen']:.2f}, "
              f"defer {ratios['defer']:.2f} (+ one step pass per optimizer step)")
    if args.json:
        write_json_atomic(args.json, {"args": vars(args), "sites": results})


def pretrain_child(*extra) -> int:
    """One ``--train`` run (``sys.argv``: script, :data:`CHILD`, its flags): the tiny Llama
    with the default extensions, :func:`cpu_timer` and ``extra`` (extension factories)."""
    from megatron_ext.defaults import default_extensions
    from megatron_ext.training.pretrain import main

    sys.argv = [sys.argv[0], *sys.argv[2:]]
    return main("llama", extensions=default_extensions(cpu_timer, *extra))


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:  # one --train run
        raise SystemExit(pretrain_child())
    raise SystemExit(run_cli(run))
