"""The sections of ``benchmarks/gpu_check.py``: each ``name(args, out) -> dict`` (see there)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import gpu_profile
from benchmarks.gpu_profile import profile  # noqa: F401  (the section, by name)
from benchmarks.gpu_syncs import syncs  # noqa: F401  (the section, by name)

REPO = Path(__file__).resolve().parents[1]


def _time(fn, repeat: int = 10) -> float:
    """Median seconds of ``fn()`` on the GPU (after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def env(args, out) -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": _version("triton"),
            "megatron-core": _version("megatron-core"), "highspy": _version("highspy"),
            "transformer-engine": _version("transformer-engine"), "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1)}


def _pretrain(extra: list, run_dir: Path, timeout: int = 300) -> dict:
    """Run ``pretrain_llama.py`` with ``extra``; its metrics and the tail of its output."""
    cmd = [sys.executable, str(REPO / "pretrain_llama.py"), "--run-dir", str(run_dir), *extra]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.open()] if metrics.exists() else []
    result = {"returncode": proc.returncode, "records": records}
    if proc.returncode != 0:
        result["error"] = (proc.stdout[-1500:] + proc.stderr[-2500:]).strip()
    else:
        result["log"] = [line for line in proc.stdout.splitlines()
                         if line.startswith(("precision:", "attention", "llama"))][:6]
    return result


def main(args, out) -> dict:
    run = _pretrain(["--train-iters", str(args.main_steps), "--no-save"], out / "main")
    records = run.pop("records", [])
    losses = [r for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    run.update(first_loss=losses[0]["loss"] if losses else None,
               last_loss=losses[-1]["loss"] if losses else None, val_losses=val[-3:])
    return run


def formats(args, out) -> dict:
    """Every format's GPU path (``benchmarks/quantize.py``'s :func:`run`: x ``clone()``, target
    <= 3x, and bit-identical to the CPU reference), then ``to_fp8`` for the real-FP8 formats."""
    from benchmarks.quantize import run
    from megatron_ext.formats import get_format
    from megatron_ext.formats.fp8 import to_fp8

    rows = [{k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
            for row in run("cuda", budget_s=args.formats_budget)]
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(4096, 4096, device="cuda", dtype=dtype) * 3
        x_cpu = x.cpu()
        clone_s = _time(lambda: x.clone())
        for name in ("fp8_e4m3", "fp8_e4m3@row", "fp8_e4m3@tile128", "fp8_e4m3@block128"):
            fmt = get_format(name)
            got, ref = to_fp8(x, fmt), to_fp8(x_cpu, fmt)
            same = (torch.equal(got.data.cpu().view(torch.uint8), ref.data.view(torch.uint8))
                    and torch.equal(got.scale.cpu(), ref.scale))
            s = _time(lambda: to_fp8(x, fmt))
            rows.append({"format": f"to_fp8 {name}", "dtype": str(dtype)[6:],
                         "bit_identical": same, "x_clone": round(s / clone_s, 2)})
        rows.append(_two_passes(x, clone_s))
        rows.append(_pair(x, x_cpu, clone_s))
    timed = [r for r in rows if "x_clone" in r]
    return {"rows": rows, "all_bit_identical": all(r.get("bit_identical") is not False
                                                   for r in timed),
            "worst_x_clone": max((r["x_clone"] for r in timed), default=None)}


def _two_passes(x: torch.Tensor, clone_s: float) -> dict:
    """Per-tensor ``to_fp8``'s two passes apart, x ``clone()``: the amax reduction
    (``vector_norm``) and the scale-and-cast kernel (which one to make faster)."""
    from megatron_ext.formats import fp8, get_format
    from megatron_ext.formats.triton_fp8 import scale_and_cast

    fmt, (rows, cols) = get_format("fp8_e4m3"), x.shape
    amax = fp8._block_amax(x, rows, cols)
    dtype = fp8.FP8_DTYPES["fp8_e4m3"]
    reduce_s = _time(lambda: fp8._block_amax(x, rows, cols))
    cast_s = _time(lambda: scale_and_cast(x, amax, rows, cols, fmt.element, dtype))
    return {"format": "to_fp8 fp8_e4m3, each pass", "dtype": str(x.dtype)[6:],
            "amax x clone": round(reduce_s / clone_s, 2),
            "cast x clone": round(cast_s / clone_s, 2)}


def _pair(x: torch.Tensor, x_cpu: torch.Tensor, clone_s: float) -> dict:
    """Per-tensor ``to_fp8_pair`` (the cast writing both layouts, as fprop's ``x`` and dgrad's
    ``dy`` take it): both bit-identical with the CPU path along either axis, x ``clone()``."""
    from megatron_ext.formats import get_format
    from megatron_ext.formats.fp8 import to_fp8, to_fp8_pair

    fmt = get_format("fp8_e4m3")
    got = to_fp8_pair(x, fmt)
    same = all(torch.equal(g.data.cpu().view(torch.uint8), r.data.view(torch.uint8))
               and torch.equal(g.scale.cpu(), r.scale)
               for g, r in zip(got, (to_fp8(x_cpu, fmt), to_fp8(x_cpu.t(), fmt))))
    pair_s = _time(lambda: to_fp8_pair(x, fmt))
    return {"format": "to_fp8_pair fp8_e4m3 (both layouts)", "dtype": str(x.dtype)[6:],
            "bit_identical": same, "x_clone": round(pair_s / clone_s, 2)}


def stquant(args, out) -> dict:
    """STQuant's fused Triton step against torch's AdamW (foreach and fused) at TinyLlama's
    widths x 8 layers (target <= 1.5x), and its codes against the CPU path
    (``benchmarks/stquant_step.py``'s :func:`run`)."""
    from benchmarks.stquant_step import run

    return {"rows": [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                     for row in run("cuda")]}


def gemm(args, out) -> dict:
    """FP8 GEMMs against BF16 at the model's shapes: the GEMM alone and with quantization."""
    from benchmarks.gpu_check import GEMM_SHAPES
    from megatron_ext.formats import fake_quant, get_format
    from megatron_ext.formats.fp8 import to_fp8
    from megatron_ext.precision import real_gemm

    recipes = {"per-tensor": ("fp8_e4m3", "fp8_e4m3"),
               "per-row": ("fp8_e4m3@row", "fp8_e4m3@row"),
               "blockwise 1x128 x 128x128": ("fp8_e4m3@tile128", "fp8_e4m3@block128"),
               "blockwise 1x128 x 1x128": ("fp8_e4m3@tile128", "fp8_e4m3@tile128")}
    rows, support, measured = [], {}, []
    for name, (fa, fb) in recipes.items():
        support[name] = real_gemm.supported(fa, fb, torch.bfloat16, torch.device("cuda"))
    for m, k, n in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16 = _time(lambda: a @ b.t())
        row = {"shape": f"{m}x{k}x{n}", "bf16 TFLOP/s": round(2 * m * k * n / bf16 / 1e12)}
        times = {"m": m, "k": k, "n": n, "bf16_s": bf16, "native": [], "emulated": []}
        for name, (fa, fb) in recipes.items():
            if support[name] is None:
                row[name] = "unsupported"
                continue
            fa_, fb_ = get_format(fa), get_format(fb)
            qa, qb = to_fp8(a, fa_), to_fp8(b, fb_)
            alone = _time(lambda: real_gemm.scaled_mm(qa, qb, torch.bfloat16))
            whole = _time(lambda: real_gemm.fp8_gemm(a, fa_, b, fb_))
            row[name] = f"{bf16 / alone:.2f}x ({bf16 / whole:.2f}x with quantization)"
            times["native"].append({"a": fa, "b": fb, "gemm_s": alone, "total_s": whole})
        for fa, fb in EMULATED_PAIRS:
            fq_a, fq_b = get_format(fa), get_format(fb)
            emulated = _time(lambda: fake_quant(a, fq_a) @ fake_quant(b, fq_b).t())
            row[f"emulated {fa} x {fb}"] = f"{bf16 / emulated:.2f}x"
            times["emulated"].append({"a": fa, "b": fb, "total_s": emulated})
        rows.append(row)
        measured.append(times)
    trials = {" x ".join(map(str, key)): seen for key, seen in real_gemm.TRIALS.items()}
    return {"rows": rows, "support": support, "trials": trials,
            "device_profile": write_profile(measured, out, torch.cuda.get_device_name())}


EMULATED_PAIRS = (("fp8_e4m3@tile128", "fp8_e4m3@block128"), ("mxfp4", "mxfp4"),
                  ("nvfp4", "nvfp4"))
"""Operand formats of the fake-quantized GEMMs the gemm section times."""


def write_profile(measured: list[dict], out, name: str) -> str:
    """Write the device profile ``measured`` gives on the card ``name`` (``--device-profile
    FILE`` reads it) and the table beside it; returns the profile's path."""
    from megatron_ext.precision.measured_profile import measurement_base, profile_from_gemm

    profile = profile_from_gemm(measured, measurement_base(name), name)
    (out / "gemm_measured.json").write_text(json.dumps(measured, indent=1))
    path = out / "device_profile.json"
    path.write_text(profile.to_json())
    return str(path)


def fp8_tensor_plan(out: Path) -> Path:
    """``<out>/fp8_tensor_plan.json``: every site of the 22 layers in per-tensor E4M3."""
    from megatron_ext.precision.plan import PrecisionPlan, save_plan
    from megatron_ext.precision.site_formats import SiteFormats
    from megatron_ext.sites import all_site_ids

    plan_file = out / "fp8_tensor_plan.json"
    per_tensor = SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e4m3")
    save_plan(PrecisionPlan({s: per_tensor for s in all_site_ids(22)}, method="fp8-tensor"),
              str(plan_file))
    return plan_file


def train(args, out) -> dict:
    """Tokens/s and peak memory of each training row at the TinyLlama-1.1B shape."""
    from benchmarks.gpu_check import TRAIN_CONFIGS, row_flags

    plan_file = fp8_tensor_plan(out)
    plans = {f"{m}_plan": out / f"train_{m}" / "precision_plan.json" for m in ("pgq", "snip")}
    rows = []
    for name in args.train_configs:
        run_dir = out / ("train_" + "".join(c if c.isalnum() else "_" for c in name))
        flags = [f.format(fp8_tensor_plan=plan_file, **plans) for f in TRAIN_CONFIGS[name]]
        run = _pretrain([*row_flags(flags), "--train-iters", str(args.train_steps)], run_dir)
        records = [r for r in run.get("records", []) if "tokens_per_s" in r]
        timed = [r for r in records if r["step"] > 3] or records
        row = {"config": name}
        if name == "snip" and "error" not in run:
            row["refresh x step memory"] = _refresh_ratio(run_dir)
        if timed:
            row["tokens/s"] = round(statistics.median(r["tokens_per_s"] for r in timed))
            row["step ms"] = round(1e3 * statistics.median(r["step_time_s"] for r in timed))
            row["peak GiB"] = round(max(r.get("mem_gib", 0) for r in records), 1)
            row["loss"] = round(records[-1]["loss"], 3)
            row.update(_profile_cost(run_dir, run.get("records", []), timed))
        if "error" in run:
            row["error"] = run["error"][-1200:]
        row["log"] = run.get("log")
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = next((r["tokens/s"] for r in rows if r["config"] == "bf16" and "tokens/s" in r), None)
    for row in rows:
        if base and "tokens/s" in row:
            row["x bf16"] = round(row["tokens/s"] / base, 2)
    from benchmarks.step_estimates import compare

    return {"rows": rows, "step_estimates": compare(out, rows)}


def _profile_cost(run_dir: Path, records: list, timed: list) -> dict:
    """PGQ's profile time (``pgq_profile_s``) per profiled batch over a median training step
    (target <= 2x), and its last batch's (no first-use kernel compilation); empty for rows
    without a profile."""
    record = next((r for r in records if "pgq_profile_s" in r), None)
    if record is None:
        return {}
    batches = json.loads((run_dir / "args.json").read_text())["pgq_profile_steps"]
    step = statistics.median(r["step_time_s"] for r in timed)
    profile = record["pgq_profile_s"]
    return {"profile s": round(profile, 2),
            "profile batch x step": round(profile / batches / step, 2),
            "last profile batch x step": round(record["pgq_profile_last_batch_s"] / step, 2)}


def _refresh_ratio(run_dir: Path):
    """``benchmarks/snip_memory.py``'s refresh / normal-step peak memory (target <= 1.15)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from snip_memory import refresh_vs_step

    try:
        return round(refresh_vs_step(run_dir)["ratio"], 3)
    except (ValueError, OSError) as exc:
        return str(exc)


def pytest(args, out) -> dict:
    """``pytest`` with CUDA visible; each test's outcome is printed (``-v``), so a run cut off
    at ``--pytest-timeout`` still names the tests that failed before."""
    cmd = [sys.executable, "-m", "pytest", *args.pytest_paths, "-v", "-n", "12",
           "-p", "no:cacheprovider", "--timeout", "120"]
    env = {**os.environ, "MEGATRON_EXT_CACHE": str(out / "cache")}
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env,
                              timeout=args.pytest_timeout)
        text, result = proc.stdout, {"returncode": proc.returncode}
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        result = {"error": f"timed out after {args.pytest_timeout} s"}
    return {**result, **pytest_outcomes(text)}


def pytest_outcomes(text: str) -> dict:
    """Passed count, failed / errored test lines and the last lines of ``pytest -v``'s output
    (xdist's ``[gw3] [ 62%] FAILED tests/...::test_x``)."""
    lines = text.strip().splitlines()
    return {"passed": sum(" PASSED " in line for line in lines),
            "failed": [line for line in lines if " FAILED " in line or " ERROR " in line],
            "tail": lines[-8:]}


def markdown(results: dict) -> str:
    """The results as markdown tables (env, issue 22's targets, GEMMs, training, formats,
    pytest)."""
    from benchmarks.gpu_targets import markdown as target_lines

    lines = ["## GPU check", ""]
    env_ = results.get("env", {})
    lines += [" | ".join(f"{k} {v}" for k, v in env_.items()), ""] + target_lines(results)
    for section in ("gemm", "train", "formats", "stquant", "syncs"):
        rows = results.get(section, {}).get("rows")
        if not rows:
            lines += [f"{section}: {results.get(section, {}).get('error', 'not run')}", ""]
            continue
        keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("log", "error")]
        lines += [f"### {section}", "", "| " + " | ".join(keys) + " |",
                  "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
        lines += [f"error in {r.get('config', r)}: {r['error'][-300:]}" for r in rows
                  if r.get("error")] + [""]
    lines += gpu_profile.markdown(results.get("profile", {}))
    for section in ("main", "pytest"):
        lines += [f"### {section}", "", "```",
                  json.dumps({k: v for k, v in results.get(section, {}).items()
                              if k != "records"}, indent=1)[:3000], "```", ""]
    return "\n".join(lines)
