"""tools/export_plan.py: a PrecisionPlan as megatron-core's per-module TE recipe.

Checked with megatron-core's own code: the written YAML is loaded by ``RecipeConfig``, every
module path of a built megatron ``GPTModel`` goes through megatron's matcher and
``TEQuantizationParams``, and megatron's own rule (``_get_should_context_be_quantized_params``)
says whether the module runs quantized — expected outcomes are written out by hand per test.
Megatron's recipe -> TE constructor code is run against a mock TE to check each table row
builds the TE recipe it names, and the table is cross-checked with ``precision/te.py``.
"""

import importlib.util
import subprocess
import sys
from unittest import mock

import pytest
import yaml
from megatron.core.extensions import transformer_engine as mcore_te
from megatron.core.quantization.quant_config import RecipeConfig
from megatron.core.quantization.utils import get_quant_config_or_none

from megatron_ext.precision.plan import PrecisionPlan, save_plan
from megatron_ext.precision.controller import compose
from megatron_ext.precision.policies import UNIFORM, keep_overlay, uniform_plan
from megatron_ext.precision.recipe_export import RECIPES, export_plan, write_recipe
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.sites import SITES, site_id

from precision_helpers import REPO, megatron_world  # noqa: F401  (fixture)

_SPEC = importlib.util.spec_from_file_location("_export_plan_tool",
                                               REPO / "tools" / "export_plan.py")
TOOL = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(TOOL)

BF16 = "bf16"
TENSOR, TENSOR_HYBRID = ("tensorwise", "e4m3", None), ("tensorwise", "hybrid", None)
BLOCK, BLOCK_HYBRID = ("blockwise", "e4m3", None), ("blockwise", "hybrid", None)
MX, MX_HYBRID = ("mxfp8", "e4m3", None), ("mxfp8", "hybrid", None)
NVFP4 = (None, None, "nvfp4")
LINEARS = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
           "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}
NV = SiteFormats("nvfp4", "nvfp4", "nvfp4+sr")


def _model(layers: int):
    from megatron_ext.training import model as model_lib
    from megatron_ext.training.arguments import parse_args

    args = parse_args("llama", ["--mock-data", "--num-layers", str(layers),
                                "--global-batch-size", "8", "--micro-batch-size", "8"],
                      world_size=1)
    return model_lib.build_model_chunks(args, model_lib.transformer_config(args), 512)[0]


@pytest.fixture(scope="module")
def model4(megatron_world):
    return _model(4)


def _resolve(path, model) -> dict:
    """Module path -> what megatron-core makes of the recipe file for it: ``"bf16"``, or
    ``(fp8 recipe, fp8 format, fp4 recipe)`` of a quantized module."""
    recipe = RecipeConfig.from_yaml_file(str(path))
    out = {}
    for name, _ in model.named_modules():
        config = get_quant_config_or_none(name, recipe)  # what GPTModel gives finish_init
        params = config and mcore_te.TEQuantizationParams.parse_from_config(config)
        runs = {mcore_te._get_should_context_be_quantized_params(params, True, ctx)
                for ctx in (False, True)}
        assert len(runs) == 1, f"{name}: depends on the global autocast"
        r = params.training_recipe
        out[name] = ((r.fp8_quantization_recipe, r.fp8_quantization_recipe and r.fp8_format,
                      r.fp4_quantization_recipe) if runs.pop() else BF16)
    return out


def _check(plan, model, tmp_path, expected: dict, **kw):
    """Write ``plan``'s recipe, resolve ``model``'s modules; ``expected``: (layer, site) ->
    outcome, every other module unquantized. Returns the export."""
    export = export_plan(plan, **kw)
    write_recipe(export, str(tmp_path / "recipe.yaml"))
    got = _resolve(tmp_path / "recipe.yaml", model)
    paths = {f"decoder.layers.{layer}.{LINEARS[site]}": want
             for (layer, site), want in expected.items()}
    assert set(paths) <= set(got)
    assert {name: got[name] for name in paths} == paths
    assert all(v == BF16 for name, v in got.items() if name not in paths), (
        "a module outside the plan's sites got quantized")
    return export


def _every(layers, outcome):
    return {(layer, s): outcome for layer in layers for s in SITES}


def test_uniform_fp8_is_blockwise_fp8_on_every_linear(model4, tmp_path):
    export = _check(uniform_plan("fp8", 4), model4, tmp_path, _every(range(4), BLOCK))
    assert export.unexpressed() == []


def test_layers_kept_in_bf16_match_no_quantization(model4, tmp_path):
    plan = compose(uniform_plan("fp8", 4), [keep_overlay(1, 4)])
    expected = {**_every((0, 3), BF16), **_every((1, 2), BLOCK)}
    assert _check(plan, model4, tmp_path, expected, num_layers=4).unexpressed() == []


def test_a_mixed_plan_every_recipe(model4, tmp_path):
    plan = PrecisionPlan({
        "L0.qkv": SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e4m3"),
        "L0.proj": SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e5m2"),
        "L0.fc1": SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@block128", "fp8_e5m2@tile128"),
        "L0.fc2": SiteFormats("mxfp8", "mxfp8", "mxfp8"),
        "L1.qkv": SiteFormats("mxfp8", "mxfp8", "mxfp8_e5m2"),
        "L1.proj": NV,
        "L1.fc1": SiteFormats("bf16", "none", "BF16"),
        "L2.qkv": SiteFormats("FP8_E4M3@Tile128", "fp8_e4m3@BLOCK128", "fp8_e4m3@tile128"),
        # an override that repeats the role's format changes nothing
        "L2.fc2": SiteFormats(*UNIFORM["fp8"].to_dict().values(),
                              overrides=(("wgrad.x", "fp8_e4m3@tile128"),)),
    })
    expected = {(0, "qkv"): TENSOR, (0, "proj"): TENSOR_HYBRID, (0, "fc1"): BLOCK_HYBRID,
                (0, "fc2"): MX, (1, "qkv"): MX_HYBRID, (1, "proj"): NVFP4, (2, "qkv"): BLOCK,
                (2, "fc2"): BLOCK}
    assert _check(plan, model4, tmp_path, expected).unexpressed() == []


UNEXPRESSIBLE = {
    "L0.qkv": (UNIFORM["fp4"], "no TE recipe"),
    "L0.proj": (SiteFormats("mxfp8", "nvfp4", "mxfp8"), "mixes 4- and 8-bit operands"),
    "L1.fc1": (SiteFormats("fp8_e4m3", "fp8_e4m3", "bf16"), "dy unquantized"),
    "L1.fc2": (SiteFormats("nvfp4", "nvfp4", "nvfp4"), "rounds dy stochastically"),
    "L2.qkv": (SiteFormats("mxfp8", "mxfp8", "mxfp8", overrides=(("wgrad.x", "bf16"),)),
               "per-GEMM overrides (wgrad.x bf16)"),
    "L2.proj": (SiteFormats("none", "none", "none", overrides=(("fprop.w", "mxfp8"),)),
                "per-GEMM overrides (fprop.w mxfp8)"),
    "L2.fc1": (SiteFormats("fp8_e4m3@tile128+sr", "fp8_e4m3@block128", "fp8_e4m3@tile128"),
               "rounds every operand to nearest"),
}


def test_unexpressible_sites_run_bf16_and_are_listed(model4, tmp_path):
    plan = PrecisionPlan({**{sid: f for sid, (f, _) in UNEXPRESSIBLE.items()},
                          "L3.fc2": UNIFORM["fp8"]})
    export = _check(plan, model4, tmp_path, {(3, "fc2"): BLOCK})
    reasons = {s.site: s.reason for s in export.unexpressed()}
    assert sorted(reasons) == sorted(UNEXPRESSIBLE)
    for sid, (_, words) in UNEXPRESSIBLE.items():
        assert words in reasons[sid], reasons[sid]
    comment = [line for line in (tmp_path / "recipe.yaml").read_text().splitlines()
               if line.startswith("#")]
    assert all(any(line.startswith(f"#   {sid} (") for line in comment) for sid in reasons)


def test_pipeline_split_folds_layers_onto_chunk_paths(megatron_world, tmp_path):
    """Under PP=2 each stage's chunk names its layers decoder.layers.0/1: a 2-layer model
    has exactly those module paths."""
    model2 = _model(2)
    mx, fp8 = SiteFormats("mxfp8", "mxfp8", "mxfp8"), UNIFORM["fp8"]
    plan = PrecisionPlan({site_id(layer, s): (mx if layer % 2 == 0 else fp8)
                          for layer in range(4) for s in SITES})
    export = _check(plan, model2, tmp_path, {**_every([0], MX), **_every([1], BLOCK)},
                    num_layers=4, layers_per_chunk=2)
    assert export.unexpressed() == []
    # keep-first-last-layers-bf16 differs between stages: L0 (bf16) and L2 (fp8) share paths
    kept = compose(uniform_plan("fp8", 4), [keep_overlay(1, 4)])
    export = _check(kept, model2, tmp_path, _every([0, 1], BF16), num_layers=4,
                    layers_per_chunk=2)
    listed = {s.site: s.reason for s in export.unexpressed()}
    assert sorted(listed) == sorted(site_id(layer, s) for layer in (1, 2) for s in SITES)
    assert listed["L2.qkv"].startswith("planned unlike L0.qkv, which has the same module path")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.key)
def test_each_row_builds_the_te_recipe_it_names(recipe, tmp_path, monkeypatch):
    """megatron-core's own recipe -> TE code, run against a mock TE."""
    te = mock.MagicMock()
    monkeypatch.setattr(mcore_te, "te", te)
    monkeypatch.setattr(mcore_te, "FP8GlobalStateManager",
                        mock.Mock(is_fp8_enabled=lambda: False), raising=False)
    monkeypatch.setattr(mcore_te, "fp8_autocast", lambda **kw: kw, raising=False)
    monkeypatch.setattr(mcore_te, "model_parallel_is_initialized", lambda: False)
    plan = PrecisionPlan({"L0.qkv": SiteFormats(*recipe.formats)})
    write_recipe(export_plan(plan), str(tmp_path / "r.yaml"))
    qc = get_quant_config_or_none("decoder.layers.0.self_attention.linear_qkv",
                                  RecipeConfig.from_yaml_file(str(tmp_path / "r.yaml")))
    params = mcore_te.TEQuantizationParams.parse_from_config(qc)
    autocast = mcore_te._get_fp8_autocast_for_quant_params(params, training=True)
    assert autocast["enabled"] is True
    name, fmt = recipe.te_recipe.rstrip(")").split("(")
    built = getattr(te.common.recipe, name)
    assert autocast["fp8_recipe"] is built.return_value
    # megatron builds NVFP4 with TE's defaults (E2M1 is its only format)
    expected = {} if fmt == "E2M1" else {"fp8_format": getattr(te.common.recipe.Format, fmt)}
    assert built.call_args.kwargs == expected


def test_write_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "recipe.yaml"
    out.write_text("old")
    monkeypatch.setattr(yaml, "safe_dump", mock.Mock(side_effect=RuntimeError("disk full")))
    with pytest.raises(RuntimeError):
        write_recipe(export_plan(uniform_plan("fp8", 1)), str(out))
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["recipe.yaml"]


def test_the_header_stays_a_comment(tmp_path):
    plan = uniform_plan("fp8", 1).replace(method="x\nmatchers: {}")
    write_recipe(export_plan(plan), str(tmp_path / "r.yaml"))
    assert len(RecipeConfig.from_yaml_file(str(tmp_path / "r.yaml")).matchers) == 5


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(PrecisionPlan({"L0.qkv": UNIFORM["fp8"], "L1.fc2": UNIFORM["fp4"]},
                            method="snip"), str(path))
    return path


def test_cli_writes_a_recipe_and_lists_what_it_cannot_express(plan_file, tmp_path, capsys):
    out = tmp_path / "sub" / "recipe.yaml"
    assert TOOL.main(["--plan", str(plan_file), "--out", str(out), "--num-layers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "not expressible, run in BF16 by this recipe: 1 site" in printed
    assert "L1.fc2 (x fp4_e2m1@tile128" in printed and f"wrote {out}" in printed
    recipe = RecipeConfig.from_yaml_file(str(out))
    assert [m.config_key for m in recipe.matchers] == ["fp8_blockwise", "bf16"]


def _bad_cases(plan_file, tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    bad_plan = tmp_path / "badplan.json"
    bad_plan.write_text('{"version": 1, "sites": {"L0.qkv": {"x": "fp9", "w": "bf16", '
                        '"dy": "bf16"}}}')
    out = str(tmp_path / "r.yaml")
    return {
        "missing plan": (["--plan", str(tmp_path / "nope.json"), "--out", out],
                         "No such file"),
        "not JSON": (["--plan", str(bad_json), "--out", out], "not valid JSON"),
        "bad format": (["--plan", str(bad_plan), "--out", out], "unknown format 'fp9'"),
        "out below a file": (["--plan", str(plan_file), "--out", str(plan_file / "r.yaml")],
                             "is a file, not a folder"),
        "out a folder": (["--plan", str(plan_file), "--out", str(tmp_path)], "is a folder"),
        "site beyond the model": (["--plan", str(plan_file), "--out", out, "--num-layers",
                                   "1"], "unknown site L1.fc2"),
        "split without layers": (["--plan", str(plan_file), "--out", out,
                                  "--pipeline-model-parallel-size", "2"], "needs --num-layers"),
        "uneven split": (["--plan", str(plan_file), "--out", out, "--num-layers", "3",
                          "--pipeline-model-parallel-size", "2"], "does not split evenly"),
        "zero stages": (["--plan", str(plan_file), "--out", out,
                         "--pipeline-model-parallel-size", "0"], "must be >= 1"),
    }


@pytest.mark.parametrize("case", ["missing plan", "not JSON", "bad format", "out below a file",
                                  "out a folder", "site beyond the model",
                                  "split without layers", "uneven split", "zero stages"])
def test_cli_bad_input_is_one_line_exit_2_no_file(case, plan_file, tmp_path, capsys):
    argv, words = _bad_cases(plan_file, tmp_path)[case]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert TOOL.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_script_entry_point_bad_input(tmp_path):
    """The real script: megatron-core's import warnings must not add stderr lines."""
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "export_plan.py"), "--plan",
                           str(tmp_path / "nope.json"), "--out", str(tmp_path / "r.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: cannot read")
