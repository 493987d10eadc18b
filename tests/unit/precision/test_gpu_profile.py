"""gpu_check's ``profile`` section (``benchmarks/gpu_profile.py``): the kernel-name classifier
on real Hopper kernel names, and the table built from a CPU profiler trace of a tiny step."""

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_profile import GROUPS, classify, profile_table, trace_kernels

HOPPER = {  # names as torch.profiler reports them on an H100 / H200 (CUDA 12-13, torch 2.x)
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
    "segment_k_off_kernel__5x_cublas": "GEMM",
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "GEMM",
    "cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_f32_bf16_bf16_128x128x128_2x1x1_0_tnn_align16_"
    "warpspecialized_cooperative_fp8_fastaccum_epi_tma": "GEMM",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "GEMM",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
    "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, "
    "false, true, false, false, true, true, false, false>(FLASH_NAMESPACE::Flash_fwd_params)":
        "attention",
    "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64, 128, 128, "
    "8, 4, 2, 4, false, false, cutlass::bfloat16_t> >(FLASH_NAMESPACE::Flash_bwd_params)":
        "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
    "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)":
        "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor"
    "<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, double, "
    "double, double, bool const*, bool const*>(...)": "optimizer",
    "void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, float>(float "
    "const*, at::native::TensorListAddresses, int)": "optimizer",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)":
        "communication",
    "triton_poi_fused_mul_silu_0": "elementwise",
    "triton_red_fused__log_softmax_0": "elementwise",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
    "BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::"
    "MulFunctor<float> > >(at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, ...)":
        "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::"
    "TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#14}::operator()() "
    "const::{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned "
    "int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, "
    "at::native::memory::StoreWithCast<1> >(int, ..., c10::Float8_e4m3fn)": "quantize",
    "_scale_cast_kernel": "quantize",
    "_amax_kernel": "quantize",
    "_quantize_blocks_kernel": "quantize",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
    "float, false>(int, float, c10::BFloat16 const*, ...)": "norm",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, "
    "unsigned int, 2, 2, -2, true>(...)": "other",
}


@pytest.mark.parametrize("name, group", HOPPER.items(), ids=[n[:40] for n in HOPPER])
def test_the_classifier_groups_hopper_kernels(name, group):
    assert classify(name) == group


def _outermost(kernels):
    """The ops no other op encloses (a CPU trace nests aten ops; GPU kernels do not)."""
    kernels = sorted(kernels, key=lambda k: (k.start_us, -k.dur_us))
    out, end = [], float("-inf")
    for k in kernels:
        if k.start_us >= end:
            out.append(k)
            end = k.start_us + k.dur_us
    return out


def test_the_table_of_a_cpu_trace_of_a_tiny_step(tmp_path):
    weights = [torch.randn(32, 32, requires_grad=True) for _ in range(2)]
    optimizer = torch.optim.AdamW(weights, foreach=True)
    x = torch.randn(8, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):  # two "steps": 2 GEMMs, a norm, an add, the optimizer
            h = torch.nn.functional.layer_norm(torch.mm(torch.mm(x, weights[0]), weights[1]),
                                               (32,))
            for w in weights:
                w.grad = torch.ones_like(w) * h.detach().mean()
            optimizer.step()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    kernels = _outermost(trace_kernels(json.loads((tmp_path / "trace.json").read_text()),
                                       "cpu_op"))
    table = profile_table(kernels, 2, {"GEMM": "0.1"})
    rows = {r["group"]: r for r in table["rows"]}
    assert set(rows) <= set(GROUPS)
    assert rows["GEMM"]["launches/step"] == 2 and rows["GEMM"]["prediction"] == "0.1"
    assert rows["norm"]["launches/step"] == 1 and rows["norm"]["prediction"] == "-"
    assert rows["optimizer"]["launches/step"] >= 1
    assert sum(r["launches/step"] for r in rows.values()) == table["launches/step"]
    assert sum(float(r["share"][:-1]) for r in rows.values()) == pytest.approx(100, abs=0.5)
    assert 0 < table["busy ms/step"] <= table["span ms/step"]
    assert table["host gaps ms/step"] == pytest.approx(
        table["span ms/step"] - table["busy ms/step"], abs=2e-3)


def test_the_worker_profiles_the_steps_after_the_warmup(tmp_path):
    """The worker (the tiny Llama, on CPU: its operators stand in for kernels) writes the
    profiled steps' operations, GEMMs and the optimizer among them; the run trains all steps."""
    from pretrain_runner import FAST_ARGS, launch, train_losses

    trace = tmp_path / "kernels.json"
    launch(["--trace", str(trace), "--warmup", "2", "--steps", "1", "--", *FAST_ARGS,
            "--train-iters", "3", "--no-save", "--run-dir", str(tmp_path / "run")],
           script="benchmarks/gpu_profile.py")
    assert sorted(train_losses(tmp_path / "run")) == [1, 2, 3]
    groups = {classify(name) for name, start, dur in json.loads(trace.read_text())}
    assert {"GEMM", "optimizer", "norm"} <= groups
