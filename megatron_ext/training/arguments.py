"""Command-line flags (Megatron-LM names where the meaning is the same); their checks are in
:mod:`.flag_checks`.

Features add flags through ``extra_args_provider(parser) -> parser`` (Megatron-LM's seam) and
validate them in ``extra_validators``; everything else reads the parsed namespace.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Iterable

import torch

from megatron_ext.training.distributed import resolve_launch
from megatron_ext.training.flag_checks import validate_args
from megatron_ext.training.input_checks import check_inputs
from megatron_ext.errors import OneLineParser, UsageError, finite_float
from megatron_ext.training.attention_backend import CHOICES as ATTENTION_BACKENDS
from megatron_ext.training.presets import ARCH_FIELDS, get_preset, preset_names
from megatron_ext.training.run_dir import default_run_dir

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (each overrides the --model preset)")
    g.add_argument("--model", default="tiny", help=f"size preset: {', '.join(preset_names())}")
    for name, what in (("num-layers", "transformer layers"), ("hidden-size", "model width"),
                       ("ffn-hidden-size", "MLP width"),
                       ("num-attention-heads", "attention heads"),
                       ("num-query-groups", "key/value heads (GQA; = heads: plain attention)"),
                       ("seq-length", "tokens per sample"),
                       ("max-position-embeddings", "longest sequence the positions cover"),
                       ("vocab-size", "vocabulary size (the tokenizer's if the preset has "
                                      "none)")):
        g.add_argument(f"--{name}", type=int, default=None, help=f"{what}; from --model")
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default=None,
                   help="rotary or learned absolute positions; from --model")
    g.add_argument("--rotary-base", type=finite_float, default=None, help="RoPE theta; from --model")
    g.add_argument("--use-rope-scaling", action=argparse.BooleanOptionalAction, default=None,
                   help="Llama 3.x RoPE frequency scaling (megatron-core's: low / high frequency "
                        "factors 1 / 4, original context 8192); default off")
    g.add_argument("--rope-scaling-factor", type=finite_float, default=None,
                   help="Llama 3.x RoPE scaling factor (with --use-rope-scaling); default 8.0")
    g.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"], default=None,
                   help="layer norm kind; from --model")
    g.add_argument("--norm-epsilon", type=finite_float, default=None,
                   help="epsilon of the layer norms; from --model")
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=None,
                   help="SwiGLU MLP (Llama) instead of a GeLU MLP (GPT); from --model")
    g.add_argument("--openai-gelu", action=argparse.BooleanOptionalAction, default=None,
                   help="GeLU's tanh approximation (OpenAI GPT-2's gelu_new) instead of the "
                        "exact GeLU; default off")
    g.add_argument("--add-bias-linear", action=argparse.BooleanOptionalAction, default=None,
                   help="biases in the linear layers (GPT) or none (Llama); from --model")
    g.add_argument("--untie-embeddings-and-output-weights",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="separate input embedding and output layer (Llama) or one shared "
                        "matrix (GPT); from --model")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (independent of TP, so the "
                        "layout never changes the model); TP must divide the padded size")
    g.add_argument("--transformer-impl", choices=["auto", "local", "transformer_engine"],
                   default="auto", help="layer implementation; auto = Transformer Engine when "
                   "it is installed, a GPU is present and neither per-layer precision nor "
                   "--attention-backend sdpa/local asks for megatron-core's local layers, "
                   "else the local layers")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="core attention: sdpa = torch's scaled_dot_product_attention (fused "
                   "flash / memory-efficient kernels, no s x s probabilities kept; local "
                   "layers), local = megatron-core's unfused DotProductAttention, flash / "
                   "fused / unfused = Transformer Engine's (TE layers); auto = sdpa in local "
                   "layers, TE's own choice in TE layers (docs/attention.md)")
    g.add_argument("--bias-swiglu-fusion", action=argparse.BooleanOptionalAction, default=True,
                   help="SwiGLU as megatron-core's fused function, compiled by torch.compile "
                   "(CUDA only: CPU runs stay unfused); default on (docs/performance.md)")
    g.add_argument("--cross-entropy-loss-fusion", action=argparse.BooleanOptionalAction,
                   default=True, help="megatron-core's native fused cross-entropy, compiled by "
                   "torch.compile (CUDA and --bf16 only); default on (docs/performance.md)")
    g.add_argument("--hidden-dropout", type=finite_float, default=0.0,
                   help="dropout after attention and MLP, in [0, 1)")
    g.add_argument("--attention-dropout", type=finite_float, default=0.0,
                   help="dropout of the attention probabilities, in [0, 1)")
    g.add_argument("--init-method-std", type=finite_float, default=0.02,
                   help="standard deviation of the normal weight initialisation")


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="TP: ranks that split every layer's matrices")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="PP: pipeline stages, each holding consecutive layers")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="enables the interleaved (virtual pipeline) 1F1B schedule")
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="optional check: must equal world_size / (TP*PP)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with TP: split norms and dropout along the sequence too")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over the data-parallel ranks (ZeRO-1)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="shard weights, gradients and optimizer state over data parallel with "
                        "megatron-core's TorchFullyShardedDataParallel (torch FSDP2; GPU or "
                        "CPU, with TP and PP; needs untied embeddings; docs/parallelism.md)")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="megatron-core Megatron-FSDP (GPU only; docs/parallelism.md)")
    g.add_argument("--distributed-backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="torch.distributed backend; auto = NCCL with CUDA, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=finite_float, default=10.0, metavar="MIN",
                   help="a collective that waits longer than this for a peer ends the run "
                        "with one line naming the peer")


def _optimizer_flag(g, optimizers: Iterable[tuple[str, str]]) -> None:
    """``--optimizer``: megatron-core's ``adam``, or one an extension of the run brings."""
    choices = {"adam": "megatron-core's AdamW (float32 moments)", **dict(optimizers)}
    g.add_argument("--optimizer", choices=list(choices), default="adam",
                   help="; ".join(f"{name}: {what}" for name, what in choices.items()))


def _training_flags(p: argparse.ArgumentParser, optimizers=()) -> None:
    g = p.add_argument_group("training")
    _optimizer_flag(g, optimizers)
    g.add_argument("--train-iters", type=int, default=400,
                   help="train until this many optimizer steps in total (a resumed run "
                        "continues its count)")
    g.add_argument("--micro-batch-size", type=int, default=8,
                   help="samples per forward/backward pass on one rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default: micro-batch-size x "
                        "data-parallel size: no accumulation)")
    g.add_argument("--lr", type=finite_float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=finite_float, default=3e-4,
                   help="learning rate at the end of the decay")
    g.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="linear warm-up steps (default: 5%% of --lr-decay-iters)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "WSD"],
                   default="cosine", help="shape of the decay from --lr to --min-lr")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="steps over which the rate decays (default: --train-iters)")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: length of the final decay (default: 20%% of --lr-decay-iters)")
    g.add_argument("--lr-wsd-decay-style", choices=["linear", "cosine", "exponential",
                                                    "minus_sqrt"], default="linear",
                   help="WSD: shape of the final decay")
    g.add_argument("--weight-decay", type=finite_float, default=0.1, help="AdamW weight decay")
    g.add_argument("--adam-beta1", type=finite_float, default=0.9, help="AdamW beta1")
    g.add_argument("--adam-beta2", type=finite_float, default=0.95, help="AdamW beta2")
    g.add_argument("--adam-eps", type=finite_float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--clip-grad", type=finite_float, default=1.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    g.add_argument("--seed", type=int, default=1234,
                   help="seed of the initialisation, data order and dropout")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="BF16 params/compute (default: on with CUDA, off (FP32) on CPU)")


def _data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefix(es), optionally weighted: 0.7 a 0.3 b "
                        "(default: the embedded corpus, built on first use)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    g.add_argument("--tokenizer-model", default=None,
                   help="tokenizer.json (HF tokenizers) or 'byte'; default: the corpus' BPE")
    g.add_argument("--eod-token", default=None,
                   help="the tokenizer.json's end-of-document token, e.g. '</s>' (not in "
                        "Megatron-LM; default: the eos_token of a tokenizer_config.json beside "
                        "it, else the first of <|endoftext|> <|end_of_text|> </s> <eos> it has)")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens, no files")
    g.add_argument("--data-cache-path", default=None, help="where dataset index caches go")


def _logging_and_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation, logging and checkpoints")
    g.add_argument("--eval-interval", type=int, default=100,
                   help="validate every N steps (and after the last)")
    g.add_argument("--eval-iters", type=int, default=10,
                   help="global batches per validation (0: no validation)")
    g.add_argument("--log-interval", type=int, default=10,
                   help="print and record a training step every N steps")
    g.add_argument("--tensorboard-dir", default=None,
                   help="also write the metrics as TensorBoard events here")
    g.add_argument("--run-dir", default=None,
                   help="the run's folder, one run at a time (a new run into a folder that "
                        "holds one is refused; --load resumes it); default: runs/<timestamp> "
                        "of rank 0's clock")
    g.add_argument("--save", default=None, help="checkpoint dir (default: <run-dir>/checkpoints)")
    g.add_argument("--no-save", action="store_true", help="write no checkpoint at all")
    g.add_argument("--load", default=None, help="resume from this checkpoint dir")
    g.add_argument("--load-unverified", action="store_true",
                   help="with --load: accept a checkpoint without checksums.json (written "
                        "before checksums existed); its files are then not verified")
    resume = g.add_mutually_exclusive_group()
    resume.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                        help="with --load: keep the checkpoint's learning-rate schedule even "
                             "if the flags describe another (a mismatch is an error otherwise)")
    resume.add_argument("--override-opt_param-scheduler", action="store_true",
                        help="with --load: use the flags' learning-rate schedule, from the "
                             "checkpoint's step on, instead of the checkpoint's")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: take the model weights only (fresh optimizer, step 0)")
    g.add_argument("--save-retain", type=int, default=None, metavar="N",
                   help="keep only the newest N checkpoints under --save (default: keep all)")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (a final checkpoint is always written)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving a checkpoint) once the iteration is a multiple of N")
    g.add_argument("--check-flags", action="store_true",
                   help="check every flag (the trainer's and each method's) and the output "
                        "folders, print 'flags ok' and exit: starts nothing "
                        "(tools/compare_precision.py checks each run so before training any)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says its default or
    there is nothing to say (``None``, ``False``: an unset option or an off switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser(family: str, extra_args_provider: ArgsProvider | None = None,
                 optimizers: Iterable[tuple[str, str]] = ()):
    """Training's flags, then the provider's; ``optimizers``: the ``(name, help)`` of each
    ``--optimizer`` choice the run's extensions bring (``Extension.optimizers``)."""
    parser = OneLineParser(
        prog=f"pretrain_{family}.py",
        description=f"Pretrain a {family} model with megatron-core (CPU/gloo or GPU/NCCL).",
        formatter_class=HelpFormatter, allow_abbrev=False,  # as Megatron-LM: flags in full
    )
    _model_flags(parser)
    _parallel_flags(parser)
    _training_flags(parser, optimizers)
    _data_flags(parser)
    _logging_and_checkpoint_flags(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


MULTI_VALUE = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction,
               argparse._HelpAction)
"""Actions that may be given more than once; every other flag takes one value."""


def given_flags(parser: argparse.ArgumentParser, argv: Iterable[str] | None,
                once: Iterable[str] = ()) -> set[str]:
    """The option strings ``argv`` gives (``--flag value`` and ``--flag=value``);
    ``UsageError`` for a single-value flag of ``once`` given twice (``--precision snip
    --precision pgq`` would silently take the last). Other flags keep argparse's (and
    Megatron-LM's) last-wins: scripts and grids override a base command line that way."""
    argv, once = (sys.argv[1:] if argv is None else list(argv)), set(once)
    seen: dict[int, list[str]] = {}
    for token in argv:
        if token == "--":
            break
        action = parser._option_string_actions.get(token.split("=", 1)[0])
        if action is not None:
            seen.setdefault(id(action), []).append(token.split("=", 1)[0])
            flags = seen[id(action)]
            if (len(flags) > 1 and not isinstance(action, MULTI_VALUE) and
                    once.intersection(action.option_strings)):
                raise UsageError(f"{' and '.join(dict.fromkeys(flags))} given {len(flags)} "
                                 "times: the flag takes one value, give it once")
    return {flag for flags in seen.values() for flag in flags}


def parse_args(family: str, argv: Iterable[str] | None = None,
               extra_args_provider: ArgsProvider | None = None,
               world_size: int | None = None,
               optimizers: Iterable[tuple[str, str]] = ()) -> argparse.Namespace:
    """Parse and validate; raises UsageError (one line) on bad input."""
    parser = build_parser(family, extra_args_provider, optimizers)
    args = parser.parse_args(argv)
    args.family = family
    try:
        arch = get_preset(family, args.model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    args.from_preset = [f for f in ARCH_FIELDS if getattr(args, f) is None]
    for field in args.from_preset:  # flag wins over preset
        setattr(args, field, getattr(arch, field))
    if world_size is None:
        world_size = resolve_launch().world_size
    args.world_size = world_size
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available()
    validate_args(args)
    check_inputs(args)  # values that parse but cannot work (training/input_checks.py)
    run_dir = save = None
    if args.load:  # a resume goes on in place
        from megatron_ext.training.checkpointing import resume_in_place
        run_dir, save = resume_in_place(args.load, args.finetune)
    if args.run_dir is None:
        args.run_dir = run_dir or default_run_dir()  # one per launch: run_dir.claim_run_dir
    if args.save is None and not args.no_save:
        args.save = save or os.path.join(args.run_dir, "checkpoints")
    return args
