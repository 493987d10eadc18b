"""STQuant inside megatron-core's optimizer, in one process: the inner AdamW replaced, small
tensors float32, the bytes measured as stored, SNIP's reader sees the dequantized moments, and
the checkpoint holds codes + scales per parameter that restore the state exactly."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext.errors import UsageError
from megatron_ext.methods.stquant.adamw import QuantizedAdamW
from megatron_ext.methods.stquant.extension import stquant_extension
from megatron_ext.methods.stquant.flags import OPTIMIZER, config_from_args
from megatron_ext.methods.stquant.quantizer import QState, dequantize
from megatron_ext.training.optimizer import adam_moments, main_params
from pretrain_runner import FAST_ARGS


@pytest.fixture(scope="module")
def run():
    from megatron.core import parallel_state

    from megatron_ext.compat import cpu
    from megatron_ext.extension import args_provider
    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.loop import data_iterators, train_step
    from megatron_ext.training.pretrain import setup

    ext = stquant_extension()
    args = parse_args("llama", [*FAST_ARGS, "--no-save", "--optimizer", "stquant-adamw"],
                      args_provider([ext]), world_size=1, optimizers=[OPTIMIZER])
    ext.validate(args)
    training = setup(args, [ext])
    iterator = data_iterators(args, training.datasets[0], 0, 1)
    for _ in range(3):
        train_step(args, training.model, training.optimizer, training.scheduler, iterator)
    yield training
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    cpu.deactivate()


def test_inner_optimizer_is_replaced_and_small_tensors_stay_float32(run):
    params = list(main_params(run.optimizer))
    assert all(isinstance(mp.sub.optimizer, QuantizedAdamW) for mp in params)
    for mp in params:
        state = mp.sub.optimizer.state[mp.main]
        if mp.model.numel() < 4096:  # norms
            assert torch.is_tensor(state["exp_avg"]) and state["exp_avg"].shape == mp.main.shape
        else:
            assert isinstance(state["exp_avg"], QState) and state["exp_avg"].mode == "linear"
            assert state["exp_avg_sq"].mode == "log"
            assert state["exp_avg"].bits in (4, 8, 16, 32)
    assert run.optimizer.allocator.step == 3


def test_metrics_count_the_bytes_as_stored(run):
    nbytes = numel = quantized = 0
    for mp in main_params(run.optimizer):
        state = mp.sub.optimizer.state[mp.main]
        numel += mp.main.numel()
        for q in (state["exp_avg"], state["exp_avg_sq"]):
            if isinstance(q, QState):
                quantized += mp.main.numel() / 2
                nbytes += q.codes.numel() * q.codes.element_size()
                nbytes += 0 if q.scales is None else 4 * q.scales.numel()
            else:
                nbytes += 4 * q.numel()
    got = run.optimizer.metrics()
    assert got["stquant_state_bytes_per_param"] == pytest.approx(nbytes / numel, rel=1e-12)
    assert got["stquant_quantized_fraction"] == pytest.approx(quantized / numel, rel=1e-12)
    assert 4 <= got["stquant_avg_bits"] <= 32


def test_per_part_bits_and_bytes_from_the_stored_state(run):
    """Blocks vs embedding / output layer: bits per parameter (32 for float32 state), code
    and scale bytes per parameter, read off the stored moments by name; the time average
    is the mean of every call's values."""
    sums = {part: [0.0] * 4 for part in ("blocks", "embed")}
    for e in run.optimizer.allocator.entries:
        state = e.param.sub.optimizer.state[e.param.main]
        part = "embed" if e.name.split(".")[0] in ("embedding", "output_layer") else "blocks"
        m = state["exp_avg"]
        row = sums[part]
        row[0] += e.param.main.numel()
        row[1] += e.param.main.numel() * (m.bits if isinstance(m, QState) else 32)
        for q in (m, state["exp_avg_sq"]):
            quantized = isinstance(q, QState)
            row[2] += q.codes.numel() * q.codes.element_size() if quantized else 4 * q.numel()
            row[3] += 4 * q.scales.numel() if quantized and q.scales is not None else 0
    allocator = run.optimizer.allocator
    before, calls = allocator.part_sums, allocator.part_calls
    got = run.optimizer.metrics()
    assert sums["embed"][0] > 0 and sums["blocks"][0] > sums["embed"][0]
    for i, part in enumerate(("blocks", "embed")):
        n, bits, codes, scales = sums[part]
        assert got[f"stquant_params/{part}"] == n
        assert got[f"stquant_bits/{part}"] == pytest.approx(bits / n, rel=1e-12)
        assert got[f"stquant_code_bytes/{part}"] == pytest.approx(codes / n, rel=1e-12)
        assert got[f"stquant_scale_bytes/{part}"] == pytest.approx(scales / n, rel=1e-12)
        past = 0.0 if before is None else before[4 * i + 1].item() / n
        assert got[f"stquant_bits_avg/{part}"] == pytest.approx(
            (past + bits / n) / (calls + 1), rel=1e-12)


def test_snip_reads_the_dequantized_moments(run):
    mp = next(mp for mp in main_params(run.optimizer) if mp.model.numel() >= 4096)
    inner = mp.sub.optimizer
    moments = adam_moments(inner, mp.main)
    state = inner.state[mp.main]
    assert moments["exp_avg"].shape == mp.main.shape
    assert torch.equal(moments["exp_avg_sq"].reshape(-1), dequantize(state["exp_avg_sq"]))
    assert float(moments["step"]) == 3.0


def _as_loaded(sharded: dict) -> dict:
    """What dist_checkpointing hands back for ``sharded``: each object's data (cloned) in
    place of the object, slices by their place among the parameter's slices."""
    slices = {key: {str(obj.global_offset[0]): _deep_clone(obj.data)}
              for key, obj in sharded["slices"].items()}
    return {"stquant": {**sharded, "slices": slices,
                        "param_groups": sharded["param_groups"].data}}


def test_checkpoint_holds_codes_and_scales_per_parameter_and_restores_exactly(run):
    sharded = run.optimizer.sharded_state_dict({})["stquant"]
    assert sharded["format"] == 2 and sharded["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    assert sharded["allocator"]["layers"] == run.optimizer.allocator.layers
    fc1 = "optimizer.stquant.decoder.layers.mlp.linear_fc1.weight[1].tp0"  # by layer, not rank
    assert sharded["slices"][fc1].key == fc1
    assert sharded["table"][fc1]["slices"] == [[0, sharded["table"][fc1]["numel"]]]
    some = next(o.data for o in sharded["slices"].values()
                if isinstance(o.data["exp_avg"], dict) and o.data["exp_avg"]["bits"] < 32)
    assert some["exp_avg"]["codes"].dtype in (torch.uint8, torch.int16)
    assert some["exp_avg"]["scales"].dtype == torch.float32
    before = {e.name: e.param.sub.optimizer.state[e.param.main]
              for e in run.optimizer.allocator.entries}
    loaded = _as_loaded(sharded)
    for e in run.optimizer.allocator.entries:  # wipe the state
        e.param.sub.optimizer.state[e.param.main] = {}
    run.optimizer.load_state_dict(loaded)
    for e in run.optimizer.allocator.entries:
        after = e.param.sub.optimizer.state[e.param.main]
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = before[e.name][key], after[key]
            assert (torch.equal(dequantize(a), dequantize(b)) if isinstance(a, QState)
                    else torch.equal(a, b))
        assert torch.equal(before[e.name]["step"], after["step"])


def test_the_load_request_names_the_saved_slices(run):
    sharded = run.optimizer.sharded_state_dict({})["stquant"]
    request = run.optimizer.sharded_state_dict({}, is_loading=True, metadata={
        "saved_common": {"stquant": sharded}})["stquant"]
    assert ({k: [o.unique_key for o in v.values()] for k, v in request["slices"].items()} ==
            {k: [o.unique_key] for k, o in sharded["slices"].items()})


@pytest.mark.parametrize("change, message", [
    (lambda s: {**s, "layout": {**s["layout"], "tp": 2}}, "saved at TP 2 x PP 1"),
    (lambda s: {k: v for k, v in s.items() if k != "format"}, "earlier per-rank format"),
])
def test_another_tp_or_the_per_rank_format_is_refused(run, change, message):
    sharded = run.optimizer.sharded_state_dict({})["stquant"]
    with pytest.raises(UsageError, match=message):
        run.optimizer.sharded_state_dict({}, is_loading=True,
                                         metadata={"saved_common": {"stquant": change(sharded)}})


def test_other_layers_are_refused(run):
    sharded = run.optimizer.sharded_state_dict({})["stquant"]
    allocator = {**sharded["allocator"], "layers": sharded["allocator"]["layers"][1:]}
    with pytest.raises(UsageError, match="STQuant layers differ"):
        run.optimizer.load_state_dict(_as_loaded({**sharded, "allocator": allocator}))


def _deep_clone(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _deep_clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_clone(v) for v in value]
    return value


@pytest.mark.parametrize("flags, message", [
    (["--stquant-block-size", "63"], "--stquant-block-size must be an even number"),
    (["--stquant-update-every", "0"], "--stquant-update-every >= 1"),
    (["--stquant-ema", "0"], "--stquant-ema must be in"),
    (["--stquant-tau", "-1"], "--stquant-tau must be positive"),
    (["--stquant-thresholds", "12", "6.8", "24"], "--stquant-thresholds must be increasing"),
    (["--use-torch-fsdp2"], "stquant does not run with --use-torch-fsdp2: .* not with FSDP"),
])
def test_bad_flags_are_one_line_usage_errors(flags, message):
    from megatron_ext.extension import args_provider, refuse_conflicts
    from megatron_ext.training.arguments import parse_args

    extension = stquant_extension()
    args = parse_args("llama", ["--optimizer", "stquant-adamw", *flags],
                      args_provider([extension]), world_size=1, optimizers=[OPTIMIZER])
    with pytest.raises(UsageError, match=message):
        refuse_conflicts([extension], args)
        config_from_args(args)
