"""Optimizer-state bytes per parameter, final validation loss and optimizer step time of the
same tiny training run under FP32 AdamW, STQuant and torchao's 8- / 4-bit AdamW.

    python benchmarks/optimizer_memory.py                       # 400 steps, every optimizer
    python benchmarks/optimizer_memory.py --steps 100 --optimizers adamw stquant
    python benchmarks/optimizer_memory.py --seeds 1234 1235 1236 --json r.json   # gaps per seed

Each optimizer is one real run of pretrain_llama.py (the tiny Llama on the embedded corpus,
same seed and data), in a worker process of this script that adds a measuring extension:
after every step it sums the bytes of the inner torch optimizer's state (codes, scales, maps
and float32 tensors; STQuant's own count; the step counters excluded) over all parameters,
and it times megatron's ``optimizer.step()`` (gradient copy, clipping and the update).
torchao's optimizers replace megatron's inner AdamW over the same parameter groups, as
STQuant does. bitsandbytes is not installed here (no CPU wheel), so it is not measured.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ext.errors import OneLineParser, UsageError, run_cli  # noqa: E402
from megatron_ext.io import write_text_atomic  # noqa: E402

OPTIMIZERS = {
    "adamw": ["--optimizer", "adam"],
    "stquant": ["--optimizer", "stquant-adamw"],
    "stquant-4bit": ["--optimizer", "stquant-adamw", "--stquant-fixed-bits", "4"],
    "stquant-8bit": ["--optimizer", "stquant-adamw", "--stquant-fixed-bits", "8"],
    "stquant-torch": ["--optimizer", "stquant-adamw", "--stquant-cpu-kernel", "torch"],
    "stquant-8bit-torch": ["--optimizer", "stquant-adamw", "--stquant-fixed-bits", "8",
                           "--stquant-cpu-kernel", "torch"],
    "torchao-8bit": ["--optimizer", "adam"],
    "torchao-4bit": ["--optimizer", "adam"],
}
"""Name -> pretrain flags (the torchao ones also swap the inner optimizer in the worker). On
CPU, ``stquant*`` steps with the compiled kernel, ``*-torch`` with the torch path."""


def _tensor_bytes(t, seen: set) -> int:
    """Bytes of ``t`` — of its inner tensors for a tensor subclass (torchao's states) —
    counting shared storage (a quantization map) once."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n), seen) for n in names)
    if t.data_ptr() in seen:
        return 0
    seen.add(t.data_ptr())
    return t.numel() * t.element_size()


def state_bytes(optimizer) -> tuple[int, int]:
    """(state bytes, parameters) of a (single-process) megatron optimizer."""
    from megatron_ext.training.optimizer import main_params

    total, numel, seen = 0, 0, set()
    for mp in main_params(optimizer):
        inner = mp.sub.optimizer
        numel += mp.main.numel()
        if hasattr(inner, "state_nbytes"):  # STQuant: codes + scales, or float32
            total += sum(inner.state_nbytes(mp.main))
            continue
        total += sum(_tensor_bytes(v, seen) for k, v in inner.state.get(mp.main, {}).items()
                     if k != "step")
    return total, numel


def _torchao(name: str, inner):
    """torchao's AdamW8bit / AdamW4bit over ``inner``'s parameter groups. torchao keeps the
    learning rate as a tensor and refuses the float megatron's scheduler writes: turned back
    into a tensor before each step."""
    import torch
    from torchao.optim import AdamW4bit, AdamW8bit

    cls = AdamW8bit if name == "torchao-8bit" else AdamW4bit
    group = inner.param_groups[0]
    opt = cls(inner.param_groups, lr=group["lr"], betas=group["betas"], eps=group["eps"],
              weight_decay=group["weight_decay"])
    step = opt.step

    def step_with_tensor_lr(*args, **kwargs):
        for g in opt.param_groups:
            if not torch.is_tensor(g["lr"]):
                g["lr"] = torch.tensor(float(g["lr"]))
        return step(*args, **kwargs)

    opt.step = step_with_tensor_lr
    return opt


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""The clocks ``--clock`` chooses from."""


def measuring_extension(name: str, clock: str = "wall"):
    """The worker's extension: swap in torchao if asked, time the step, count the bytes."""
    from megatron_ext.extension import Extension

    times: list[float] = []

    def wrap_optimizer(args, model, optimizer):
        if name.startswith("torchao"):
            for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
                sub.optimizer = _torchao(name, sub.optimizer)
        step = optimizer.step

        def timed():
            start = CLOCKS[clock]()
            result = step()
            times.append(CLOCKS[clock]() - start)
            return result

        optimizer.step = timed
        return optimizer

    def on_step(args, run, state):
        nbytes, numel = state_bytes(run.optimizer)
        return {"bench_state_bytes_per_param": nbytes / numel, "bench_opt_step_s": times[-1]}

    return lambda controller: Extension("bench", wrap_optimizer=wrap_optimizer, on_step=on_step)


def worker(name: str, clock: str, argv: list[str]) -> int:
    from megatron_ext.defaults import default_extensions
    from megatron_ext.training.pretrain import main

    sys.argv = [sys.argv[0], *argv]
    return main("llama", extensions=default_extensions(measuring_extension(name, clock)))


def run_one(name: str, seed: int, args, work: Path) -> dict:
    run_dir = work / f"{name}-seed{seed}"
    if run_dir.exists():
        raise UsageError(f"{run_dir} exists (its metrics would be appended to): use an empty "
                         "--keep directory")
    train = ["--train-iters", str(args.steps), "--eval-interval", str(args.steps),
             "--eval-iters", str(args.eval_iters), "--log-interval", "1", "--no-save",
             "--seed", str(seed), "--run-dir", str(run_dir), *OPTIMIZERS[name]]
    proc = subprocess.run([sys.executable, __file__, "--worker", name, args.clock, "--", *train],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UsageError(f"the {name} run failed: {proc.stderr.strip().splitlines()[-1:]}")
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl", encoding="utf-8")]
    steps = [r for r in records if "loss" in r]
    timed = [r for r in steps if r["step"] > args.warmup]
    result = {"optimizer": name, "seed": seed,
              "state_bytes_per_param": steps[-1]["bench_state_bytes_per_param"],
              "final_val_loss": [r for r in records if "val_loss" in r][-1]["val_loss"],
              "final_train_loss": steps[-1]["loss"],
              "opt_step_ms": 1e3 * statistics.median(r["bench_opt_step_s"] for r in timed),
              "train_step_ms": 1e3 * statistics.median(r["step_time_s"] for r in timed)}
    if "stquant_avg_bits" in steps[-1]:
        result["avg_bits"] = steps[-1]["stquant_avg_bits"]
    return result


def report(results: list[dict]) -> str:
    """A Markdown table: per optimizer the means over seeds, the validation-loss gap to FP32
    AdamW of the same seed (mean, and the range over seeds), the median step times."""
    base = {r["seed"]: r["final_val_loss"] for r in results if r["optimizer"] == "adamw"}
    names = list(dict.fromkeys(r["optimizer"] for r in results))
    lines = ["| optimizer | state bytes / param | avg bits | final val loss | vs AdamW (range) "
             "| opt step ms | train step ms |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        rows = [r for r in results if r["optimizer"] == name]
        gaps = [100 * (r["final_val_loss"] / base[r["seed"]] - 1) for r in rows
                if r["seed"] in base]
        gap = (f"{statistics.mean(gaps):+.2f} % ({min(gaps):+.2f} .. {max(gaps):+.2f})"
               if len(gaps) > 1 else f"{gaps[0]:+.2f} %" if gaps else "")
        bits = [r["avg_bits"] for r in rows if "avg_bits" in r]
        lines.append(
            f"| {name} | {statistics.mean(r['state_bytes_per_param'] for r in rows):.3f} | "
            f"{f'{statistics.mean(bits):.2f}' if bits else ''} | "
            f"{statistics.mean(r['final_val_loss'] for r in rows):.4f} | {gap} | "
            f"{statistics.median(r['opt_step_ms'] for r in rows):.1f} | "
            f"{statistics.median(r['train_step_ms'] for r in rows):.1f} |")
    return "\n".join(lines)


def _load_results(paths: list[str]) -> list[dict]:
    results = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                results.extend(json.load(f))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--report: cannot read '{path}': {exc}") from None
    if any(not isinstance(r, dict) or not {"optimizer", "seed", "final_val_loss"} <= set(r)
           for r in results):
        raise UsageError("--report: the files are not this script's --json results")
    return results


def run(argv: list[str]) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS),
                        default=list(OPTIMIZERS), help="which optimizers to run, in order")
    parser.add_argument("--steps", type=int, default=400, help="training steps of every run")
    parser.add_argument("--eval-iters", type=int, default=20,
                        help="validation batches for the final validation loss")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timings")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234],
                        help="the runs' --seed; every optimizer runs once per seed")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="time optimizer.step() by wall time (default) or by this process's "
                        "CPU time (all its threads; steadier on a shared machine)")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the run directories (metrics, STQuant's widths) under DIR")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="run nothing: print the table of earlier --json files together")
    args = parser.parse_args(argv)
    if args.report:
        print(report(_load_results(args.report)))
        return
    if args.steps <= args.warmup or args.eval_iters < 1:
        raise UsageError("need --steps > --warmup and --eval-iters >= 1")
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(args.keep or temporary)
        results = []
        for seed in args.seeds:
            for name in args.optimizers:
                print(f"running {name}, seed {seed} ({args.steps} steps) ...", file=sys.stderr,
                      flush=True)
                results.append(run_one(name, seed, args, work))
    print(report(results))
    if args.json:
        write_text_atomic(args.json, json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3], sys.argv[5:]))
    sys.exit(run_cli(run))
