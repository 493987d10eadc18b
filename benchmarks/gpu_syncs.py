"""The ``syncs`` section of ``benchmarks/gpu_check.py``: host reads, launches and CUDA syncs
per step (``benchmarks/host_syncs.py``) and the host's time per small launch."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def syncs(args, out) -> dict:
    """Host reads and launches per step (``benchmarks/host_syncs.py``, tiny model): the
    CPU-side count of reads of device tensors beside what ``torch.cuda.set_sync_debug_mode``
    reports, per row the median over the normal unlogged steps and the most of any step;
    then the host's time per small launch (:func:`launch_cost`)."""
    from benchmarks.gpu_check import SYNC_CONFIGS, SYNC_SHAPE

    rows = []
    for name in args.sync_configs:
        run_dir = out / f"syncs_{len(rows)}"
        path = run_dir.with_suffix(".json")
        cmd = [sys.executable, str(REPO / "benchmarks" / "host_syncs.py"), "--json", str(path),
               "--", *SYNC_SHAPE, *SYNC_CONFIGS[name], "--run-dir", str(run_dir)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        row = {"config": name}
        if proc.returncode != 0:
            row["error"] = (proc.stdout[-800:] + proc.stderr[-1500:]).strip()
        else:
            row.update(sync_counts(json.loads(path.read_text())))
        print(json.dumps(row), flush=True)
        rows.append(row)
    try:
        rows += launch_cost()
    except Exception as exc:  # noqa: BLE001 - the counts above stay a result
        rows.append({"config": "launch cost", "error": f"{type(exc).__name__}: {exc}"})
    return {"rows": rows}


def launch_cost() -> list[dict]:
    """Host microseconds per call of a small launch, the GPU not waited for (what each small
    per-site op costs a step whose time is the host's): a one-value aten add, the formats'
    Triton quantizer on one 1 x 128 tile, GaussWS's perturb kernel on one 32 x 32 tile.
    Empty without a GPU."""
    if not torch.cuda.is_available():
        return []
    from megatron_ext.formats import fake_quant
    from megatron_ext.methods.gaussws.layout import ShardLayout
    from megatron_ext.methods.gaussws.triton_kernels import perturb

    one, tile = torch.ones(1, device="cuda"), torch.randn(1, 128, device="cuda").bfloat16()
    w, scale = torch.randn(32, 32, device="cuda"), torch.ones(1, 1, device="cuda")
    layout = ShardLayout.full(32, 32)
    rows = layout.global_rows("cuda")
    probes = {"aten add, 1 value": lambda: one.add(one),
              "fake_quant fp8_e4m3@tile128, 1 x 128": lambda: fake_quant(tile, "fp8_e4m3@tile128"),
              "GaussWS perturb, 32 x 32": lambda: perturb(w, scale, layout, 1, rows)}
    return [{"config": f"launch: {name}", "host us / call": _host_us(fn)}
            for name, fn in probes.items()]


def _host_us(fn, calls: int = 2000) -> float:
    """Host microseconds per ``fn()`` over ``calls`` calls after a warm-up (compilation)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(host / calls * 1e6, 1)


def sync_counts(steps: list[dict]) -> dict:
    """Median and most host reads, the median launches (and CUDA syncs, on a GPU) per step of
    a host_syncs run."""
    quiet = [s for s in steps if not s["logged"]] or steps
    row = {"reads / step": statistics.median(s["count"] for s in quiet),
           "most reads": max(s["count"] for s in steps),
           "launches / step": statistics.median(s["launches"] for s in quiet)}
    if "cuda_syncs" in steps[0]:
        row.update({"CUDA syncs / step": statistics.median(s["cuda_syncs"] for s in quiet),
                    "most CUDA syncs": max(s["cuda_syncs"] for s in steps)})
        sources = Counter()
        for s in quiet:
            sources.update(s.get("cuda_sync_sources", {}))
        row["CUDA syncs by source / step"] = {k: round(n / len(quiet), 1)
                                              for k, n in sources.most_common(5)}
    return row
