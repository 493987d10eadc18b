"""--dry-run: real megatron stages on the meta device in one process, and the estimates.

Independent references: Llama-3-70B's published parameter count (70,553,706,496 with
vocabulary 128256), closed-form parameter counts of the Llama / GPT layer, the formulas of
Korthikanti et al. 2022 and megatron-core's warm-up count, evaluated by hand.
"""

import json
import time

import pytest
import torch.distributed as dist

from pretrain_runner import launch
from megatron_ext.compat import cpu
from megatron_ext.defaults import default_extensions
from megatron_ext.training.dry_run import estimates as est
from megatron_ext.errors import UsageError
from megatron_ext.training.pretrain import pretrain

LLAMA3_70B = ["--model", "llama3-70b", "--tensor-model-parallel-size", "4",
              "--pipeline-model-parallel-size", "8", "--data-parallel-size", "2",
              "--micro-batch-size", "1", "--global-batch-size", "1024", "--seq-length", "8192"]


def dry(argv, family="llama", extensions=()):
    return pretrain(family, [*argv, "--dry-run"], list(extensions))


def test_llama3_70b_in_one_process(tmp_path, capsys):
    out = tmp_path / "report.json"
    start = time.perf_counter()
    report = dry([*LLAMA3_70B, "--precision", "uniform:fp8", "--dry-run-json", str(out)],
                 extensions=default_extensions())
    assert time.perf_counter() - start < 15  # ~1.5 s alone; the box is shared
    assert report.total_params == 70_553_706_496
    stages = [s.params for s in report.stages]
    assert sum(p.distinct - p.shared for p in stages) == report.total_params
    assert [len(p.layers) for p in stages] == [10] * 8
    assert stages[0].pre_process and stages[-1].post_process
    assert stages[0].per_gpu == 2_401_927_168  # embedding + 10 layers, TP shard of 4
    assert report.bubble == pytest.approx(7 / (512 + 7))
    assert "snip" not in report.parts  # a method reports only when its policy runs
    assert report.parts["precision"].json["plan"] == "uniform:fp8"
    assert [s.params.stage for s in report.stages] == list(range(8))
    assert not dist.is_initialized() and not cpu.is_active()
    text = capsys.readouterr().out
    assert "70,553,706,496" in text and "SNIP" not in text and "t/mb ms" in text
    saved = json.loads(out.read_text())
    assert saved["total_params"] == report.total_params and saved["plan"] == "uniform:fp8"
    assert "ilp" not in saved and saved["stages"][0]["fp4_fraction"] == 0.0


def test_llama3_70b_snip_reports_its_ilp(capsys):
    report = dry([*LLAMA3_70B, "--precision", "snip", "--snip-budget", "0.5"],
                 extensions=default_extensions())
    ilp = report.parts["snip"].json["ilp"]
    assert ilp["status"] == "optimal" and ilp["budget"] == 0.5
    assert abs(ilp["fp4_fraction"] - 0.5) < 0.01
    assert "SNIP ILP" in capsys.readouterr().out


def _llama_params(L, h, F, a, g, V):
    d = h // a
    layer = h * (a + 2 * g) * d + a * d * h + 2 * F * h + F * h + 2 * h
    return 2 * V * h + L * layer + h


def _gpt_params(L, h, F, V, P):
    layer = (3 * h * h + 3 * h) + (h * h + h) + (h * F + F) + (F * h + h) + 4 * h
    return V * h + P * h + L * layer + 2 * h



def test_snip_sites_in_groups_bound_the_refresh(capsys):
    """--snip-sites-per-pass 8 on the 70B layout (40 sites a GPU, 512 micro-batches): the
    float64 sums of the largest group of 8, a fifth of all 40's, in 5 x 3 passes."""
    flags = [*LLAMA3_70B, "--precision", "snip", "--snip-budget", "0.5"]
    whole = dry(flags, extensions=default_extensions())
    groups = dry([*flags, "--snip-sites-per-pass", "8"], extensions=default_extensions())
    sums = [[m["accumulators"] for m in r.parts["snip"].json["snip_refresh_memory"]]
            for r in (whole, groups)]
    assert sums[1] == [s / 5 for s in sums[0]] and sums[0][1] > 70 * 2**30
    assert [s.memory.extra for s in groups.stages] < [s.memory.extra for s in whole.stages]
    out = capsys.readouterr().out
    assert "; 3 passes per refresh\n" in out
    assert "; 15 passes per refresh (5 groups of --snip-sites-per-pass 8)" in out

@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"],
                                    ["--tensor-model-parallel-size", "2",
                                     "--pipeline-model-parallel-size", "2",
                                     "--num-layers-per-virtual-pipeline-stage", "1",
                                     "--sequence-parallel", "--data-parallel-size", "2",
                                     "--global-batch-size", "32"]])
def test_counts_match_closed_form_on_every_layout(layout):
    llama = dry(["--mock-data", "--vocab-size", "4096", *layout])
    assert llama.total_params == _llama_params(4, 128, 352, 4, 2, 4096)
    gpt = dry(["--mock-data", "--vocab-size", "4096", *layout], family="gpt")
    assert gpt.total_params == _gpt_params(4, 128, 512, 4096, 128)  # tied: counted once
    for report in (llama, gpt):
        assert (sum(s.params.distinct - s.params.shared for s in report.stages) ==
                report.total_params)


def test_virtual_stages_hold_interleaved_layers():
    report = dry(["--mock-data", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
                  "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "16"])
    assert [s.params.layers for s in report.stages] == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_bad_layout_is_one_line_exit_2():
    proc = launch([*LLAMA3_70B, "--pipeline-model-parallel-size", "3", "--dry-run"],
                  check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "PP=3 does not divide --num-layers 80" in errors[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bad_layouts_in_process():
    with pytest.raises(UsageError, match="TP=3 does not divide --num-attention-heads 64"):
        dry([*LLAMA3_70B, "--tensor-model-parallel-size", "3"])
    # passes the flag checks, but megatron-core cannot shard fc1's 2 x 28672 rows over TP=3:
    # a real run would stop with a traceback, the dry run says it in one line
    with pytest.raises(UsageError, match="stage 0 .* 57344 is not divisible by 3"):
        dry([*LLAMA3_70B[:2], "--tensor-model-parallel-size", "3", "--num-query-groups", "6",
             "--num-attention-heads", "66", "--hidden-size", "8184",
             "--data-parallel-size", "1"])
    assert not dist.is_initialized() and not cpu.is_active()


def test_bad_dry_run_flags():
    with pytest.raises(UsageError, match="--dry-run-json needs --dry-run"):
        pretrain("llama", ["--dry-run-json", "x.json"], [])
    with pytest.raises(UsageError, match="tokenizer model not found"):
        dry(["--tokenizer-model", "/nonexistent/tokenizer.json", "--mock-data"])


def _layout(**kw):
    base = dict(tp=4, pp=8, dp=2, vp=1, micro_batches=512, micro_batch=1, seq=8192,
                sequence_parallel=True, bf16=True, distributed_optimizer=True, fsdp=False,
                flash_attention=False)
    return est.Layout(**{**base, **kw})


def test_model_state_bytes_are_18_or_6_plus_12_over_dp():
    assert sum(est.model_state_bytes(10, _layout(distributed_optimizer=False))) == 180
    assert sum(est.model_state_bytes(10, _layout())) == 10 * (6 + 12 / 2)
    assert (sum(est.model_state_bytes(10, _layout(bf16=False, distributed_optimizer=False)))
            == 10 * (4 + 4 + 8))
    assert sum(est.model_state_bytes(10, _layout(fsdp=True))) == 10 * 18 / 2


def test_activation_formula_of_korthikanti_table_2():
    s, b, h, a = 8192, 1, 8192, 64
    assert est.layer_activation_bytes(h, a, _layout()) == s * b * h * (34 + 5 * a * s / h) / 4
    assert (est.layer_activation_bytes(h, a, _layout(sequence_parallel=False)) ==
            s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert est.layer_activation_bytes(h, a, _layout(tp=1)) == s * b * h * (34 + 5 * a * s / h)
    assert est.layer_activation_bytes(h, a, _layout(flash_attention=True)) == s * b * h * 34 / 4


def test_in_flight_follows_megatron_warmup():
    assert [est.in_flight(k, _layout()) for k in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert est.in_flight(0, _layout(micro_batches=3)) == 3
    interleaved = _layout(vp=2)  # warm-up 2(p-k-1) + (v-1)p, plus the one in flight
    assert [est.in_flight(k, interleaved) for k in (0, 7)] == [2 * 7 + 8 + 1, 8 + 1]
    assert est.bubble_fraction(interleaved) == pytest.approx(7 / (2 * 512 + 7))
    assert est.step_time([1.0, 2.0], _layout(pp=2, vp=1, micro_batches=4)) == 5 * 2.0


def test_the_dry_run_and_the_real_run_ask_one_impl_decision():
    """One pure function decides for both (issue 24, item 4): ``auto`` is TE on a GPU node
    unless an extension brings linears; TE with custom linears is refused by both."""
    from megatron_ext.training.layer_impl import resolve_transformer_impl as impl
    assert impl("auto", custom_linears=False, te_available=True) == "transformer_engine"
    assert impl("auto", custom_linears=True, te_available=True) == "local"
    for backend in ("sdpa", "local"):  # runs in megatron-core's local layers
        assert impl("auto", False, True, attention_backend=backend) == "local"
    assert impl("auto", False, True, attention_backend="flash") == "transformer_engine"
    assert impl("local", custom_linears=False, te_available=True) == "local"
    with pytest.raises(UsageError, match="per-layer precision needs --transformer-impl local"):
        impl("transformer_engine", custom_linears=True, te_available=True)


def test_gaussws_dry_run_reports_the_local_layers_the_job_gets(capsys):
    """GaussWS asks for the quantized linears without a precision flag: the dry run (like the
    real run) gets local layers from the extensions, not from flag names."""
    dry(["--gaussws", "od", "--mock-data"], extensions=default_extensions())
    assert "layers local (auto: an extension's linears" in capsys.readouterr().out
    with pytest.raises(UsageError, match="per-layer precision needs --transformer-impl local"):
        dry(["--gaussws", "od", "--mock-data", "--transformer-impl", "transformer_engine"],
            extensions=default_extensions())


def test_te_layers_with_a_te_attention_backend_are_reported_not_refused(capsys):
    """The stages are built on local stand-ins, but the report says what the GPU job runs:
    TE layers and TE's flash attention (the real run's decisions, issue 40)."""
    from megatron_ext.precision.dry_run import GPU_CAPABILITY
    from megatron_ext.precision.real_gemm import executes_real

    for impl in ("transformer_engine", "auto"):
        report = dry(["--transformer-impl", impl, "--attention-backend", "flash"],
                     extensions=default_extensions())
        assert "layers transformer_engine" in capsys.readouterr().out
        assert report.total_params == dry([]).total_params  # the same parameters
        capsys.readouterr()
    assert executes_real("auto", GPU_CAPABILITY) and executes_real("real", None)
    assert not executes_real("auto", None) and not executes_real("auto", (8, 0))
    assert not executes_real("emulated", GPU_CAPABILITY)
