"""Reference runs that a refactor must reproduce (losses, grad norms, plans), one recording
per machine kind.

``python tests/e2e/reference_runs.py`` re-records ``reference_runs.json`` with this machine's
runs alone (only do that when a change is *meant* to alter training); ``--add`` adds (or
replaces) this machine kind's recording beside the others, for a new machine kind with the
same behaviour, after checking it against them as the test does. ``test_reference_runs.py``
re-runs the same commands and compares. Three runs: SNIP with two refreshes,
``uniform:fp8``, and the ``min-rel-err`` baseline (statistics-driven, same ILP).

A machine kind is what the float results depend on (:func:`machine`): the torch build, its
CPU kernels' instruction set, the CPU (MKL picks its GEMM kernels by vendor and model: an
AMD EPYC and an Intel Xeon, both AVX512 to torch, round float32 GEMMs differently) and a
probe, the hash of the bits of the operations a training step runs on fixed inputs.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain_runner import FAST_ARGS, launch, read_metrics  # noqa: E402

REFERENCE = Path(__file__).with_name("reference_runs.json")
_SNIP = ["--snip-start", "2", "--snip-interval", "3", "--snip-apply-lag", "1",
         "--snip-budget", "0.5"]
RUNS = {
    "snip": ["--train-iters", "8", "--precision", "snip", *_SNIP],
    "uniform_fp8": ["--train-iters", "6", "--precision", "uniform:fp8"],
    "min_rel_err": ["--train-iters", "6", "--precision", "min-rel-err", *_SNIP],
}
"""name -> pretrain flags (on top of the tests' FAST_ARGS)."""


def _cpu_model() -> str:
    """``vendor_id`` and ``model name`` of the first CPU in /proc/cpuinfo (Linux), else
    what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            fields = dict(map(str.strip, line.split(":", 1)) for line in f if ":" in line)
        return f"{fields['vendor_id']} {fields['model name']}"
    except (OSError, KeyError):
        return platform.processor() or platform.machine()


def numerical_probe() -> str:
    """Hash of the bits of a tiny Llama step's kernels at its shapes (128 tokens of width
    128, 352 x 2 gated MLP columns, 4 heads of 32, 384 padded vocabulary), one thread as
    the runs use: the GEMMs of forward, dgrad and wgrad, attention's batched GEMMs and
    softmax, RMSNorm, SiLU, cross-entropy and the reductions an optimizer step takes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x, dy = torch.randn(128, 128, generator=g), torch.randn(128, 704, generator=g)
        w1, w2 = torch.randn(704, 128, generator=g), torch.randn(128, 352, generator=g)
        q, k = torch.randn(8, 64, 32, generator=g), torch.randn(8, 64, 32, generator=g)
        logits = F.linear(x, torch.randn(384, 128, generator=g))
        h = F.linear(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5), w1)
        a = F.silu(h[:, :352]) * h[:, 352:]
        outs = [h, a, F.linear(a, w2), dy @ w1, dy.t() @ x, torch.bmm(q, k.transpose(1, 2)),
                torch.softmax(q @ k.transpose(1, 2), -1),
                logits, F.cross_entropy(logits, torch.arange(128) * 3), logits.t() @ x,
                h.square().sum(), a.norm()]
        digest = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in outs))
        return digest.hexdigest()[:16]
    finally:
        torch.set_num_threads(threads)


def machine() -> str:
    """What float results depend on: torch build, instruction set, CPU, probe."""
    return (f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()} | "
            f"{_cpu_model()} | probe {numerical_probe()}")


def _plan_sites(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["sites"]


def record_run(flags: list[str], run_dir: Path) -> dict:
    """Run ``flags`` in ``run_dir``; its per-step losses, grad norms and FP4 fractions, and
    the sites of every plan it wrote (each SNIP refresh's and the one in force at the end)."""
    launch([*FAST_ARGS, "--run-dir", str(run_dir), *flags])
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    plans = {os.path.relpath(p, run_dir): _plan_sites(p)
             for p in sorted(glob.glob(str(run_dir / "snip" / "step_*" / "plan.json")))}
    plans["precision_plan.json"] = _plan_sites(str(run_dir / "precision_plan.json"))
    return {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps],
            "fp4_flop_frac": [r["fp4_flop_frac"] for r in steps], "plans": plans}


def recordings() -> list[dict]:
    """The recorded machine kinds, each ``{"machine": ..., "runs": {name: record_run}}``."""
    return json.loads(REFERENCE.read_text())["recordings"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--add", action="store_true",
                        help="keep the other machine kinds' recordings (checked against "
                             "this machine's runs first)")
    add = parser.parse_args().add
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: record_run(flags, Path(tmp) / name) for name, flags in RUNS.items()}
    this = machine()
    kept = [r for r in recordings() if r["machine"] != this] if add else []
    if add:
        from test_reference_runs import assert_reproduced
        for other in kept:
            for name, got in runs.items():
                assert_reproduced(got, other["runs"][name], bit_for_bit=False)
    body = {"recordings": [*kept, {"machine": this, "runs": runs}]}
    REFERENCE.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {REFERENCE} ({this})")


if __name__ == "__main__":
    main()
