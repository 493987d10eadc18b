"""Names, the registry, the Format object and the package's module structure."""

import ast
import json
from pathlib import Path

import pytest
import torch

import megatron_ext.formats
from megatron_ext.formats import (
    AmaxScaling,
    Format,
    MXScaling,
    Rounding,
    available,
    fake_quant,
    get_element,
    get_format,
    parse_format,
    register,
)

REQUIRED = [
    "fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3@row", "fp8_e4m3@tile128",
    "fp8_e4m3@block128", "fp8_e5m2@tile128", "fp4_e2m1@tile128", "fp4_e2m1@block128",
    "mxfp8", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4", "int8@row", "int4@tile128",
    "fp4_e2m1@tile128+sr", "mxfp4+sr",
]  # fmt: skip


def test_required_names_are_available():
    assert set(REQUIRED) <= set(available())


@pytest.mark.parametrize("name", available())
def test_every_available_name_parses_and_round_trips(name):
    fmt = get_format(name)
    assert fmt.name == name and str(fmt) == name
    assert get_format(fmt.name) == fmt == get_format(fmt.canonical)
    assert json.loads(json.dumps({"x": str(fmt)}))["x"] == name


@pytest.mark.parametrize(
    "name,bits,stochastic,canonical,effective",
    [
        ("fp32", 32, False, "fp32@none", 32),
        ("bf16", 16, False, "bf16@none", 16),
        ("fp8_e4m3", 8, False, "fp8_e4m3@tensor", 8),
        ("fp8_e4m3@tile128", 8, False, "fp8_e4m3@tile128", 8 + 32 / 128),
        ("fp4_e2m1@block128+sr", 4, True, "fp4_e2m1@block128+sr", 4 + 32 / 128**2),
        ("mxfp4", 4, False, "fp4_e2m1@mx32", 4.25),
        ("mxfp6_e2m3", 6, False, "fp6_e2m3@mx32", 6.25),
        ("nvfp4+sr", 4, True, "fp4_e2m1@nv16+sr", 4.5),
        ("int8@row", 8, False, "int8@row", 8),
        (" MXFP8 ", 8, False, "fp8_e4m3@mx32", 8.25),
    ],
)
def test_attributes(name, bits, stochastic, canonical, effective):
    fmt = get_format(name)
    assert (fmt.bits, fmt.stochastic, fmt.canonical) == (bits, stochastic, canonical)
    assert fmt.effective_bits == pytest.approx(effective)


def test_any_combination_parses():
    fmt = parse_format("fp6_e3m2@block64+sr")
    assert fmt.scaling == AmaxScaling(rows=64, cols=64) and fmt.rounding == Rounding.STOCHASTIC
    assert parse_format("fp8_e5m2@mx").scaling == MXScaling(cols=32)
    assert parse_format("int4@tile16").scaling.name == "tile16"
    assert parse_format("fp4_e2m1@nv").canonical == "fp4_e2m1@nv16"


def test_equality_ignores_the_spelling():
    assert get_format("mxfp4") == get_format("fp4_e2m1@mx32")
    assert get_format("mxfp4") != get_format("mxfp4+sr")
    assert len({get_format("nvfp4"), get_format("fp4_e2m1@nv16")}) == 1


@pytest.mark.parametrize(
    "name,needle",
    [
        ("fp5_e2m2", "unknown element type"),
        ("fp8_e4m3@tile0", "unknown scaling"),
        ("fp8_e4m3@diag", "unknown scaling"),
        ("bf16+sr", "no stochastic rounding"),
        ("bf16@tile128", "plain cast"),
        ("int8@mx32", "small float element"),
        ("", "unknown element type"),
    ],
)
def test_bad_names_raise_a_clear_value_error(name, needle):
    with pytest.raises(ValueError, match=needle) as info:
        get_format(name)
    assert "mxfp4" in str(info.value)  # the message lists the available names


def test_non_string_name_is_a_type_error():
    with pytest.raises(TypeError):
        get_format(8)


def test_register_adds_a_name():
    fmt = register("my_grad_format", "fp4_e2m1@tile128+sr")
    assert fmt.name == "my_grad_format" and fmt.canonical == "fp4_e2m1@tile128+sr"
    assert "my_grad_format" in available()
    x = torch.randn(4, 128)
    g = torch.Generator().manual_seed(0)
    y = fake_quant(x, "my_grad_format", generator=g)
    assert torch.equal(y, fake_quant(x, "fp4_e2m1@tile128+sr", generator=g.manual_seed(0)))
    with pytest.raises(ValueError):
        register("broken", "fp4_e2m1@nowhere")
    register("my_grad_format", "fp4_e2m1@tile128+sr")  # same format again: fine
    with pytest.raises(ValueError, match="already registered"):
        register("mxfp4", "nvfp4")


def test_format_built_directly():
    fmt = Format(element=get_element("fp8_e5m2"), scaling=AmaxScaling(rows=1, cols=128))
    assert fmt.name == "fp8_e5m2@tile128" and fmt == get_format("fp8_e5m2@tile128")
    with pytest.raises(ValueError):
        Format(element=get_element("bf16"), scaling=AmaxScaling(), rounding=Rounding.NEAREST)


def _imports_of(path: Path) -> set[str]:
    """Modules of the package a file imports (relative imports, anywhere in the file), and
    any absolute ``megatron_ext`` import."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_ext"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("megatron_ext")}
    return found


def test_modules_import_no_cycle_and_nothing_else_of_ours():
    """Depth-first search over the package's own import graph (deferred imports included)."""
    root = Path(megatron_ext.formats.__file__).parent
    graph = {p.stem: _imports_of(p) for p in root.glob("*.py") if p.stem != "__init__"}
    assert graph["triton_kernels"] and graph["pipeline"]  # not vacuous
    # a module named like an exported name is shadowed by it (formats.quantize is a function)
    assert not set(graph) & set(megatron_ext.formats.__all__)
    assert not [m for deps in graph.values() for m in deps if m not in graph], graph
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import cycle: {' -> '.join([*path, module])}"
        if module not in done:
            path.append(module)
            for dep in sorted(graph[module]):
                visit(dep)
            path.pop()
            done.add(module)

    for module in sorted(graph):
        visit(module)


@pytest.mark.parametrize("name", ["fp4_e2m1", "fp8_e4m3", "nvfp4", "int8"])
@pytest.mark.parametrize("axis", [0, 1])
def test_a_shard_given_the_whole_tensors_amax_is_quantized_as_the_whole(name, axis):
    """Tensor parallelism: two halves of a tensor, each quantized with the whole tensor's
    amax, put back together are the whole tensor quantized, bit for bit; each half alone
    (its own amax) is not, for one scale per tensor."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=gen)
    x[:, :48] *= 8  # the halves (along either dim) then have different amaxes
    x[:32] *= 3
    whole = fake_quant(x, name, axis=1)
    amax = x.abs().max()
    halves = x.chunk(2, dim=axis)
    shared = torch.cat([fake_quant(h, name, axis=1, tensor_amax=amax) for h in halves], axis)
    assert torch.equal(shared, whole)
    own = torch.cat([fake_quant(h, name, axis=1) for h in halves], axis)
    if get_format(name).scaling.rows is None:  # one scale per tensor: the split shows
        assert not torch.equal(own, whole)


def test_col_scaling_is_one_scale_per_index_of_the_axis():
    """``@col`` along an axis = each slice at one index of that axis quantized with its own
    tensor scale (here: x (T, K) quantized along T, as wgrad does, gets one scale per token)."""
    import torch

    from megatron_ext.formats import fake_quant, get_format, quantize

    x = (torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
         * torch.logspace(-3, 3, 7).unsqueeze(1))  # tokens of very different magnitude
    per_token = fake_quant(x.t(), "fp4_e2m1@col", axis=-1).t()
    reference = torch.stack([fake_quant(row, "fp4_e2m1") for row in x])
    assert torch.equal(per_token, reference)
    assert not torch.equal(per_token, fake_quant(x.t(), "fp4_e2m1@row", axis=-1).t())
    assert get_format("fp8_e4m3@col").name == "fp8_e4m3@col"
    with pytest.raises(ValueError, match="no packed storage"):
        quantize(x, "fp4_e2m1@col")
