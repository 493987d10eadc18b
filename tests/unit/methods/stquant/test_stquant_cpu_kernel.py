"""STQuant's compiled CPU step (``cpu_step``) against the torch path: every width change
among 4 / 8 / 16 / 32 bits on and off the block grid (``fused_step_cases``), a trajectory
through ``QuantizedAdamW`` with changing widths, and the ``--stquant-cpu-kernel`` choice
(``auto`` falls back to the torch path in one line when the kernel does not build,
``compiled`` then refuses). The kernel is built once per session (and cached on disk by
torch): ~20 s of CPU the first time, ~0.1 s after."""

import functools
import re

import pytest
import torch

from fused_step_cases import SHARDS, WIDTHS, check_against_the_torch_path
from megatron_ext.errors import UsageError
from megatron_ext.methods.stquant import cpu_step
from megatron_ext.methods.stquant.adamw import QuantizedAdamW, Slot


@pytest.fixture(scope="module")
def module():
    return cpu_step.kernel("compiled")


@pytest.mark.parametrize("old,new", WIDTHS)
@pytest.mark.parametrize("numel,lead,group", SHARDS)
def test_kernel_matches_the_torch_path_bit_for_bit(module, old, new, numel, lead, group):
    check_against_the_torch_path(functools.partial(cpu_step.step, module), old, new, numel, lead,
                                 group)


def _trajectory(cpu_kernel: str, widths: list[list[int]]):
    """Steps of QuantizedAdamW on two quantized tensors (one off the block grid) and a float32
    one, the same gradients every run; the state after each step."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(4096, generator=g), torch.randn(70, 33, generator=g),
              torch.randn(10, generator=g)]
    now = [widths[0]]
    opt = QuantizedAdamW(params, {params[0]: Slot(0), params[1]: Slot(1, lead=9)},
                         lambda: now[0], lr=1e-2, weight_decay=0.1, cpu_kernel=cpu_kernel)
    states = []
    for w in widths:
        now[0] = w
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()
        states.append(([p.clone() for p in params],
                       [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params]))
    return states


def test_quantized_adamw_steps_as_the_torch_path(module):
    """Codes and scales bit for bit at every step (m, v never depend on p); the parameters
    within the per-step tolerance (an ulp plus 2**-21 of an update <= 10 lr) summed."""
    widths = [[16, 4], [4, 8], [8, 32], [32, 16], [32, 32], [4, 4]]
    for t, ((p, moments), (p_ref, moments_ref)) in enumerate(
            zip(_trajectory("compiled", widths), _trajectory("torch", widths)), start=1):
        for (m, v), (m_ref, v_ref) in zip(moments[:2], moments_ref[:2]):
            for q, ref in ((m, m_ref), (v, v_ref)):
                assert q.bits == ref.bits and torch.equal(q.codes, ref.codes)
                assert q.scales is None or torch.equal(q.scales, ref.scales)
        assert torch.equal(p[2], p_ref[2])  # float32 state: torch's AdamW on both
        for a, b in zip(p[:2], p_ref[:2]):
            ulp = torch.nextafter(b.abs(), torch.tensor(float("inf"))) - b.abs()
            assert ((a - b).abs() <= t * (ulp + 2**-21 * 10 * 1e-2)).all()


def test_the_build_says_its_time_once(module, capsys):
    cpu_step.kernel.cache_clear()  # loaded again from torch's cache
    assert cpu_step.kernel("auto") is cpu_step.kernel("auto") is not None
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and re.fullmatch(re.escape(
        "stquant: CPU optimizer step = the fused C++ kernel (--stquant-cpu-kernel auto), built "
        "or loaded in ") + r"\d+\.\d s", out[0]), out


@pytest.fixture
def broken_compiler(monkeypatch):
    def fail():
        raise RuntimeError("Error building extension\nc++: command not found")

    cpu_step.kernel.cache_clear()
    monkeypatch.setattr(cpu_step, "_build", fail)
    yield
    cpu_step.kernel.cache_clear()


def test_auto_falls_back_to_the_torch_path_in_one_line(broken_compiler, capsys):
    assert cpu_step.kernel("auto") is None
    assert cpu_step.kernel("auto") is None  # said once
    out = capsys.readouterr().out.splitlines()
    assert out == ["stquant: the CPU kernel does not build (c++: command not found); the CPU "
                   "optimizer step runs the torch path (--stquant-cpu-kernel torch)"]
    with pytest.raises(UsageError, match=re.escape("--stquant-cpu-kernel compiled: the C++ kernel "
                                                   "does not build (c++: command not found)")):
        cpu_step.kernel("compiled")


def test_the_flag_reaches_the_config():
    from megatron_ext.extension import args_provider
    from megatron_ext.methods.stquant.extension import stquant_extension
    from megatron_ext.methods.stquant.flags import OPTIMIZER, config_from_args
    from megatron_ext.training.arguments import parse_args

    def config(*flags):
        args = parse_args("llama", ["--optimizer", "stquant-adamw", *flags],
                          args_provider([stquant_extension()]), world_size=1,
                          optimizers=[OPTIMIZER])
        return config_from_args(args)

    assert config().cpu_kernel == "auto"
    assert config("--stquant-cpu-kernel", "torch").cpu_kernel == "torch"
    with pytest.raises(UsageError, match="--stquant-cpu-kernel: invalid choice: 'gpu'"):
        config("--stquant-cpu-kernel", "gpu")
