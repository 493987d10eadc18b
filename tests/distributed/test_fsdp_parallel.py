"""--use-torch-fsdp2 on CPU (gloo, torchrun): the same training as DDP, checkpoints that resume
exactly and load into DDP, quantized linears, and the dry run's memory rows against the bytes
each rank really holds. References: the DDP run of the same flags (megatron's
DistributedDataParallel), the uninterrupted run, and what the ranks measure themselves.
"""

import json

import pytest

from pretrain_runner import FAST_ARGS, launch, train_losses

STEPS = ["--train-iters", "8"]
FSDP = ["--use-torch-fsdp2"]


def _run(tmp, name, flags, nproc=2, check=True):
    run_dir = tmp / name
    proc = launch([*FAST_ARGS, *STEPS, "--run-dir", str(run_dir), *flags], nproc=nproc,
                  check=check)
    return (train_losses(run_dir) if check else proc)


def _close(losses, reference, rel, steps=range(1, 9)):
    assert sorted(losses) == list(steps)
    for step in steps:
        assert losses[step] == pytest.approx(reference[step], rel=rel), f"step {step}"


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ddp"), "ddp", ["--no-save"])


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """DP=2 FSDP2, saving at steps 4 and 8: (losses, save dir)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    save = tmp / "ckpt"
    return _run(tmp, "fsdp", [*FSDP, "--save-interval", "4", "--save", str(save)]), save


def test_dp2_fsdp2_equals_dp2_ddp(fsdp, ddp):
    _close(fsdp[0], ddp, rel=1e-6)
    assert abs(ddp[8] - ddp[1]) > 0.5  # it trains: the comparison is not of two idle runs


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]])
def test_fsdp2_with_tp_or_pp_equals_ddp(layout, ddp, tmp_path):
    _close(_run(tmp_path, "fsdp-x", [*FSDP, *layout, "--no-save"], nproc=4), ddp, rel=1e-6)


def test_resume_from_fsdp2_checkpoint_is_exact(fsdp, tmp_path):
    losses, save = fsdp
    resumed = _run(tmp_path, "resumed", [*FSDP, "--no-save", "--load",
                                         str(save / "iter_0000004")])
    assert resumed == {step: losses[step] for step in range(5, 9)}


def test_bf16_resume_is_exact(tmp_path):
    # BF16 params: megatron's optimizer keeps FP32 main copies of the shards, saved and loaded
    save = tmp_path / "ckpt"
    full = _run(tmp_path, "full", [*FSDP, "--bf16", "--save-interval", "4", "--save", str(save)])
    resumed = _run(tmp_path, "resumed", [*FSDP, "--bf16", "--no-save", "--load",
                                         str(save / "iter_0000004")])
    assert resumed == {step: full[step] for step in range(5, 9)}


def test_fsdp2_checkpoint_loads_into_single_process_ddp(fsdp, tmp_path):
    # the global tensors must be DDP's: megatron's SwiGLU split of an FSDP2 shard alone
    # would load fc1 scrambled here (the loss at step 5 was 5.41 instead of 5.03)
    losses, save = fsdp
    resumed = _run(tmp_path, "ddp1", ["--no-save", "--load", str(save / "iter_0000004")],
                   nproc=1)
    _close(resumed, losses, rel=1e-6, steps=range(5, 9))


def test_fp8_plan_under_fsdp2_matches_ddp(ddp, tmp_path):
    fp8 = ["--precision", "uniform:fp8", "--no-save"]
    under_fsdp = _run(tmp_path, "fsdp-fp8", [*FSDP, *fp8])
    under_ddp = _run(tmp_path, "ddp-fp8", fp8)
    assert under_fsdp[1] == pytest.approx(under_ddp[1], rel=1e-7)
    assert abs(under_fsdp[1] - ddp[1]) > 1e-5  # the quantized linears are really in use
    # FP32 summation order differs (reduce-scatter vs all-reduce): a float32-ulp perturbation,
    # which FP8 rounding of the weights amplifies chaotically once updates spread its flips
    # (measured over 8 steps: 2.5e-4 on 2026-11-22, 1.03e-3 at step 7 on another machine on
    # 2026-11-25; init perturbations of 1e-8..1e-6 move such losses by up to 4.8e-3 within 4
    # steps, test_precision_parallel). Steps 1-2, where a wrong shard or reduction would show,
    # are held to 1e-5; later steps to 1e-2, twice that band.
    _close(under_fsdp, under_ddp, rel=1e-2)
    for step in (1, 2):
        assert under_fsdp[step] == pytest.approx(under_ddp[step], rel=1e-5), f"step {step}"


def test_checkpoint_layout_fsdp2_cannot_describe_is_refused_at_start(tmp_path):
    proc = _run(tmp_path, "dp3", [*FSDP, "--micro-batch-size", "1", "--global-batch-size",
                                  "6"], nproc=3, check=False)
    assert proc.returncode != 0
    assert ("error: --use-torch-fsdp2: checkpoints need every parameter's first dimension "
            "divisible by the data-parallel size 3") in proc.stderr
    assert not (tmp_path / "dp3" / "metrics.jsonl").exists()  # before the first step


def test_megatron_fsdp_on_cpu_is_one_line(tmp_path):
    proc = _run(tmp_path, "mfsdp", ["--use-megatron-fsdp", "--no-save"], nproc=1,
                check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: --use-megatron-fsdp needs CUDA: Megatron-FSDP builds torch.device('cuda:N'), "
        "orders its buffers with torch.cuda.Stream()s and reduces gradients with NCCL's "
        "PREMUL_SUM (and needs the einops package); --use-torch-fsdp2 runs on CPU"]
    assert "Traceback" not in proc.stderr


MEMORY_LAYOUTS = {"fp32-pp2-dp2": (4, ["--no-bf16", "--pipeline-model-parallel-size", "2"]),
                  "bf16-dp2": (2, ["--bf16"])}


@pytest.mark.parametrize("name", list(MEMORY_LAYOUTS))
def test_dry_run_memory_rows_are_the_bytes_each_rank_holds(name, tmp_path):
    from megatron_ext.training.pretrain import pretrain

    nproc, flags = MEMORY_LAYOUTS[name]
    job = [*FAST_ARGS, *FSDP, *flags, "--no-save", "--run-dir", str(tmp_path / "run")]
    launch([str(tmp_path), *job], nproc=nproc, script="tests/distributed/fsdp_memory_worker.py")
    measured = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert len(measured) == nproc
    report = pretrain("llama", [*job, "--data-parallel-size", "2", "--dry-run"], [])
    for rank in measured:
        row = report.stages[rank["stage"]].memory
        assert ((rank["weights"], rank["grads"], rank["optimizer"]) ==
                (row.weights, row.grads, row.optimizer)), name
