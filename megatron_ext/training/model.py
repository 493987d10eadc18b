"""Build megatron-core ``GPTModel`` chunks (Llama or GPT flavour) from the parsed flags.

The transformer block is given to ``GPTModel`` as a ``TransformerBlockSubmodules`` holding one
layer ``ModuleSpec`` per local layer. That list is the seam the precision work uses: a layer's
linear modules (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) come from the
``linear_classes`` callback, so a quantized ``ColumnParallelLinear`` can be dropped in per layer
without touching megatron-core.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_ext.errors import UsageError
from megatron_ext.sites import COLUMN_SITES
from megatron_ext.training.attention_backend import resolve_attention_backend
from megatron_ext.training.sdpa import SDPAttention

LinearClasses = Callable[[int, str], type]
"""(global layer index, site) -> the linear module class for that site."""


def default_linear_classes(layer: int, site: str) -> type:
    return ColumnParallelLinear if site in COLUMN_SITES else RowParallelLinear


class TorchNorm:
    """torch RMSNorm / LayerNorm whose params are marked for sequence parallelism.

    megatron-core's local norm refuses sequence parallelism only because its weights would not
    be all-reduced over the TP group; tagging them ``sequence_parallel`` makes
    ``finalize_model_grads`` do exactly that.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def vocab_size(tokenizer, args: argparse.Namespace) -> int:
    """``--vocab-size`` (or the preset's) when given, else the tokenizer's; never smaller."""
    if args.vocab_size is None:
        return tokenizer.vocab_size
    if tokenizer.vocab_size > args.vocab_size:
        raise UsageError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's "
                         f"vocabulary ({tokenizer.vocab_size})")
    return args.vocab_size


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Pad to --make-vocab-size-divisible-by (not times TP: the layout must not change the model)."""
    multiple = args.make_vocab_size_divisible_by
    padded = -(-vocab_size // multiple) * multiple
    tp = args.tensor_model_parallel_size
    if padded % tp:
        raise UsageError(f"TP={tp} does not divide the padded vocabulary size {padded}")
    return padded


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU's tanh approximation (Megatron-LM's ``--openai-gelu``, Hugging Face's ``gelu_new``).

    torch's own kernel rather than megatron-core's ``openai_gelu``, which is wrapped in
    ``torch.compile`` and costs ~20 s of compilation per process on a CPU; the two agree to
    float rounding (2.4e-7 in FP32)."""
    return F.gelu(x, approximate="tanh")


def activation_func(args: argparse.Namespace) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation: SiLU for SwiGLU, else GeLU (tanh approximation with --openai-gelu)."""
    if args.swiglu:
        return F.silu
    return openai_gelu if args.openai_gelu else F.gelu


@dataclass(frozen=True)
class Fusions:
    """megatron-core's fusion switches (``TransformerConfig`` fields of the same names) that
    run on torch alone: what each needs and why it is on or off is in docs/performance.md."""

    bias_activation_fusion: bool
    """SwiGLU as megatron's ``bias_swiglu_impl``, forward and backward compiled by
    ``torch.compile`` (one kernel each, only the fc1 output kept for backward). On CUDA with
    SwiGLU; off on CPU, where inductor's C++ compile of it takes minutes, and for GeLU
    (megatron's fused GeLU is the tanh approximation and needs a bias)."""
    cross_entropy_loss_fusion: bool
    """megatron's native fused vocab-parallel cross-entropy (pieces compiled by torch).
    On CUDA in BF16 runs (its logits gradient is BF16); off on CPU (compile time)."""
    cross_entropy_fusion_impl: str = "native"
    """``native`` (torch.compile); ``te`` needs Transformer Engine."""
    bias_dropout_fusion: bool = False
    """Off: without a bias and with dropout 0 (the presets) the unfused form is already one
    add; the compiled dropout would draw from inductor's RNG, not torch's."""
    masked_softmax_fusion: bool = False
    """Off: needs Apex's softmax kernels, and SDPA (the default) has no separate softmax."""
    apply_rope_fusion: bool = False
    """Off: megatron-core's fused RoPE is Transformer Engine's."""
    gradient_accumulation_fusion: bool = False
    """Off: needs Apex's ``fused_weight_gradient_mlp_cuda``."""
    persist_layer_norm: bool = False
    """Off: Apex's persistent LayerNorm (the norms here are torch's)."""


def fusions(args: argparse.Namespace, device_type: str) -> Fusions:
    """The fusions a run with parameters on ``device_type`` (``cuda``, ``cpu``) turns on:
    those its flags allow (``--[no-]bias-swiglu-fusion``, ``--[no-]cross-entropy-loss-fusion``)
    where they run."""
    cuda = device_type == "cuda"
    return Fusions(
        bias_activation_fusion=cuda and bool(args.swiglu) and args.bias_swiglu_fusion,
        cross_entropy_loss_fusion=cuda and bool(args.bf16) and args.cross_entropy_loss_fusion)


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=activation_func(args),
        add_bias_linear=args.add_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bool(args.bf16),
        **asdict(fusions(args, device_type)),
        use_cpu_initialization=not torch.cuda.is_available(),
        # gloo matches batched sends/recvs to one peer by order: with PP=2 (next == prev) the
        # interleaved schedule would swap activations and gradients. Unbatched p2p keeps the
        # two directions on separate communicators.
        batch_p2p_comm=torch.cuda.is_available(),
        perform_initialization=True,
        cuda_graph_scope=[],  # megatron's default "full" is deprecated (it warns): same meaning
    )


def layer_spec(layer: int, linear_classes: LinearClasses,
               core_attention: type = SDPAttention) -> ModuleSpec:
    """One transformer layer (pre-norm attention + MLP) with the linears of global ``layer``
    and ``core_attention``."""
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=linear_classes(layer, "qkv"),
            core_attention=core_attention,
            linear_proj=linear_classes(layer, "proj"),
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=linear_classes(layer, "fc1"), linear_fc2=linear_classes(layer, "fc2")))
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=TorchNorm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=TorchNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            # checkpoint keys identical to Transformer Engine's fused norm+linear layout
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def block_spec(config: TransformerConfig, vp_stage: int | None, linear_classes: LinearClasses,
               impl: str = "local", attention_backend: str = "sdpa") -> TransformerBlockSubmodules:
    """The layers of ``vp_stage``; ``attention_backend`` a resolved local backend (local
    layers) or TE's (already in ``config.attention_backend``)."""
    count = get_num_layers_to_build(config, vp_stage)
    if impl == "transformer_engine":  # megatron-core's own TE spec (fused norm + linear)
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        return TransformerBlockSubmodules(
            layer_specs=[get_gpt_layer_with_transformer_engine_spec()] * count, layer_norm=TENorm)
    offset = get_transformer_layer_offset(config, vp_stage)
    core = SDPAttention if attention_backend == "sdpa" else DotProductAttention
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(offset + i, linear_classes, core) for i in range(count)],
        layer_norm=TorchNorm,
    )


def build_model_chunks(args: argparse.Namespace, config: TransformerConfig, vocab_size: int,
                       linear_classes: LinearClasses = default_linear_classes) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), not yet wrapped in DDP."""
    vp_size = args.virtual_pipeline_model_parallel_size
    backend = resolve_attention_backend(args.attention_backend, args.transformer_impl)
    if args.transformer_impl == "transformer_engine":  # GPTModel sets TE's NVTE_*_ATTN from it
        config.attention_backend = AttnBackend[backend]
    chunks = []
    for vp_stage in range(vp_size or 1):
        stage = vp_stage if vp_size else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=block_spec(config, stage, linear_classes,
                                              args.transformer_impl, backend),
            vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=int(args.rotary_base),
            rope_scaling=bool(args.use_rope_scaling),
            rope_scaling_factor=args.rope_scaling_factor,
            vp_stage=stage,
        ))
    return chunks
