"""``benchmarks/step_estimates.py`` on a fabricated ``gpu_check`` directory: the BF16 row
calibrates the profile, every row is estimated from its own args.json and plan, and the
±15 % verdict is given for the target rows only."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.step_estimates import compare, run_dir
from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.device_profile import PROFILES, resolve
from megatron_ext.precision.plan import PrecisionPlan, save_plan
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.precision.step_estimate import calibrate, step_estimate
from megatron_ext.sites import all_site_ids

REPO = Path(__file__).resolve().parents[3]
ARGS = {"num_layers": 2, "hidden_size": 2048, "ffn_hidden_size": 5632,
        "num_attention_heads": 32, "num_query_groups": 4, "swiglu": True,
        "global_batch_size": 2, "seq_length": 2048, "pipeline_model_parallel_size": 1,
        "num_layers_per_virtual_pipeline_stage": None, "padded_vocab_size": 32000}
FP8 = SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e4m3")


def _gpu_check_dir(tmp_path: Path) -> tuple[Path, list[dict]]:
    rows = [{"config": "bf16", "step ms": 12.0}, {"config": "fp8 per-tensor real",
                                                   "step ms": 11.0},
            {"config": "gaussws", "step ms": 20.0}, {"config": "snip", "error": "x"}]
    for config in ("bf16", "fp8 per-tensor real", "gaussws"):
        run_dir(tmp_path, config).mkdir()
        (run_dir(tmp_path, config) / "args.json").write_text(json.dumps(ARGS))
    save_plan(PrecisionPlan({s: FP8 for s in all_site_ids(2)}, method="fp8-tensor"),
              str(run_dir(tmp_path, "fp8 per-tensor real") / "precision_plan.json"))
    (tmp_path / "device_profile.json").write_text(PROFILES["h100"].to_json())
    (tmp_path / "gpu_check.json").write_text(json.dumps({"train": {"rows": rows}}))
    return tmp_path, rows


def test_each_row_is_estimated_on_the_calibrated_profile(tmp_path):
    out, rows = _gpu_check_dir(tmp_path)
    result = compare(out, rows)
    by = {r["config"]: r for r in result["rows"]}
    assert set(by) == {"bf16", "fp8 per-tensor real", "gaussws"}
    shape = ModelShape(2, 2048, 5632, 32, 4, True, 4096, seq_length=2048, vocab_size=32000)
    profile = calibrate(PROFILES["h100"], shape, 12e-3)
    fp8 = step_estimate(lambda sid: FP8, shape, profile)
    assert by["bf16"]["estimated ms"] == 12.0 and by["bf16"]["within 15%"] is True
    assert by["fp8 per-tensor real"]["estimated ms"] == pytest.approx(fp8.total_s * 1e3, abs=0.05)
    assert by["fp8 per-tensor real"]["quantize_s ms"] == pytest.approx(fp8.quantize_s * 1e3,
                                                                        abs=0.05)
    assert by["fp8 per-tensor real"]["within 15%"] == (abs(fp8.total_s / 11e-3 - 1) <= 0.15)
    assert by["gaussws"]["within 15%"] is None and by["gaussws"]["estimated ms"] == 12.0
    assert result["nongemm_s_per_token_layer"] == profile.nongemm_s_per_token_layer
    assert resolve(result["file"]) == profile


def test_missing_inputs_are_one_line(tmp_path):
    found = compare(tmp_path, [{"config": "fp8", "step ms": 1.0}])
    assert found == {"error": "no measured bf16 row to calibrate on"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_estimates.py"),
                           str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1


def test_gpu_check_writes_the_profile_its_gemm_table_gives(tmp_path):
    """The gemm section's writer on a fabricated table (no GPU needed): the file
    ``--device-profile`` reads is profile_from_gemm's profile, the table beside it."""
    from benchmarks.gpu_sections import write_profile
    from megatron_ext.precision.measured_profile import measurement_base, profile_from_gemm

    bf16 = 2.0 * 4096 * 2048 * 2048 / 600e12
    table = [{"m": 4096, "k": 2048, "n": 2048, "bf16_s": bf16,
              "native": [{"a": "fp8_e4m3", "b": "fp8_e4m3", "gemm_s": bf16 / 1.5,
                          "total_s": bf16}],
              "emulated": [{"a": "nvfp4", "b": "nvfp4", "total_s": 1.5 * bf16}]}]
    path = write_profile(table, tmp_path, "NVIDIA H200")
    profile = resolve(path)
    assert profile == profile_from_gemm(table, measurement_base("NVIDIA H200"), "NVIDIA H200")
    assert profile.rate("fp8_e4m3") == pytest.approx(1.5) and profile.rate("nvfp4") is None
    assert profile.bytes_per_s == PROFILES["h200"].bytes_per_s
    assert json.loads((tmp_path / "gemm_measured.json").read_text()) == table
