"""Command line of ``tools/convert_checkpoint.py`` (also ``python -m megatron_ext.convert.cli``)::

    convert_checkpoint.py hf-to-megatron --hf-dir HF --out CKPT [--tensor-model-parallel-size T
                                         --pipeline-model-parallel-size P]
    convert_checkpoint.py megatron-to-hf --load CKPT --out HF2 [--model-config JSON]
    convert_checkpoint.py verify --hf-dir HF --load CKPT [--tensor-model-parallel-size T
                                 --pipeline-model-parallel-size P] [--atol 1e-4]

Bad input: one ``error:`` line on stderr, exit status 2, nothing written. ``verify`` exits 1
when the logits differ by more than ``--atol``; with T x P > 1 it re-launches itself under
torchrun (T x P processes on gloo). The conversions themselves always run as one process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

from megatron_ext.training.arguments import HelpFormatter
from megatron_ext.training.distributed import resolve_launch
from megatron_ext.errors import UsageError


def _layout_flags(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1, help=help_text)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1, help=help_text)


def _unverified_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load-unverified", action="store_true",
                        help="accept a checkpoint without checksums.json (its files are then "
                             "not verified)")


def build_parser() -> argparse.ArgumentParser:
    defaults = HelpFormatter
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py", formatter_class=defaults,
        description="Convert between Hugging Face (Llama, GPT-2) and megatron_ext checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    to_mg = sub.add_parser("hf-to-megatron", help="Hugging Face -> megatron (weights only)",
                           formatter_class=defaults)
    to_mg.add_argument("--hf-dir", required=True, help="config.json + safetensors")
    to_mg.add_argument("--out", required=True, help="new megatron checkpoint directory")
    _layout_flags(to_mg, "layout you will train at (checked; the checkpoint loads at any)")
    to_mg.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="pad the vocabulary to a multiple of this, as pretrain does")
    to_hf = sub.add_parser("megatron-to-hf", help="megatron (any layout) -> Hugging Face",
                           formatter_class=defaults)
    to_hf.add_argument("--load", required=True, help="checkpoint dir (save root or iter_*)")
    to_hf.add_argument("--out", required=True, help="new Hugging Face model directory")
    to_hf.add_argument("--model-config", help="megatron_model.json or a run's args.json "
                       "(default: the description hf-to-megatron stored in the checkpoint)")
    to_hf.add_argument("--max-shard-size", default="5GB", help="safetensors shard size")
    _unverified_flag(to_hf)
    check = sub.add_parser("verify", help="compare megatron and Hugging Face logits (FP32)",
                           formatter_class=defaults)
    check.add_argument("--hf-dir", required=True, help="the Hugging Face model (config.json + "
                       "safetensors)")
    check.add_argument("--load", required=True,
                       help="the megatron checkpoint (save root or iter_*)")
    check.add_argument("--model-config", help="as for megatron-to-hf")
    _layout_flags(check, "layout to run the megatron model at (torchrun when T x P > 1)")
    _unverified_flag(check)
    check.add_argument("--atol", type=float, default=1e-4, help="fail above this difference")
    check.add_argument("--batch-size", type=int, default=2,
                       help="random sequences to compare the logits on")
    check.add_argument("--seq-length", type=int, default=32, help="tokens per sequence")
    check.add_argument("--seed", type=int, default=1234, help="seed of the random tokens")
    check.add_argument("--result-file", help=argparse.SUPPRESS)  # torchrun child -> parent
    return parser


def _single_process(command: str) -> None:
    if resolve_launch().world_size > 1:
        raise UsageError(f"{command} runs as one process (the checkpoint holds global tensors "
                         "that load at any layout); do not start it under a launcher")


def _hf_to_megatron(args, argv) -> int:
    from megatron_ext.convert.outputs import report_peak_memory
    from megatron_ext.convert.to_megatron import hf_to_megatron

    _single_process("hf-to-megatron")
    hf_to_megatron(args.hf_dir, args.out, args.tensor_model_parallel_size,
                   args.pipeline_model_parallel_size, args.make_vocab_size_divisible_by)
    report_peak_memory()
    return 0


def _megatron_to_hf(args, argv) -> int:
    from megatron_ext.convert.hf_files import parse_size
    from megatron_ext.convert.outputs import report_peak_memory
    from megatron_ext.convert.to_hf import megatron_to_hf

    _single_process("megatron-to-hf")
    megatron_to_hf(args.load, args.out, args.model_config, parse_size(args.max_shard_size),
                   args.load_unverified)
    report_peak_memory()
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _verify_under_torchrun(nproc: int, argv: list[str]) -> float | None:
    """Run this same verify as ``nproc`` torchrun processes; their max difference (None if
    they failed: their error is already on stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        code = subprocess.call([
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(_free_port()), "-m", "megatron_ext.convert.cli", *argv,
            "--result-file", result], env=env)
        if code != 0 or not os.path.isfile(result):
            return None
        with open(result, encoding="utf-8") as f:
            return json.load(f)["max_abs_diff"]


SHAPE_FIELDS = ("family", "vocab_size", "num_layers", "hidden_size", "ffn_hidden_size",
                "num_attention_heads", "num_query_groups")
"""What fixes the weights' shapes: a Hugging Face model that differs in one cannot be
compared (one that differs elsewhere -- RoPE scaling, the GeLU -- is, and fails on its logits)."""


def _same_architecture(spec, hf_dir: str) -> None:
    """``UsageError`` naming the first :data:`SHAPE_FIELDS` field where ``hf_dir``'s
    config.json describes another model than the checkpoint's spec, before either is loaded."""
    from megatron_ext.convert.spec import spec_from_hf_config
    from megatron_ext.io import read_json

    path = os.path.join(hf_dir, "config.json")
    hf_arch = spec_from_hf_config(read_json(path), spec.dtype)[0].arch
    for field in SHAPE_FIELDS:
        theirs, ours = getattr(hf_arch, field), getattr(spec.arch, field)
        if theirs != ours:
            raise UsageError(f"--hf-dir: '{path}' describes another model than --load: "
                             f"{field} {theirs} there, {ours} in the checkpoint")


def _verify(args, argv) -> int:
    from megatron_ext.convert.spec import find_spec
    from megatron_ext.convert.verify import verify, write_result
    from megatron_ext.training.checkpointing import resolve_checkpoint_dir

    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        raise UsageError(f"--hf-dir: no config.json in '{args.hf_dir}'")
    ckpt_dir = resolve_checkpoint_dir(args.load, args.load_unverified)
    spec = find_spec(ckpt_dir, args.model_config)
    _same_architecture(spec, args.hf_dir)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    launch = resolve_launch()
    if tp * pp > 1 and launch.world_size == 1:
        spec.megatron_args(tp, pp)  # refuse a bad layout before starting processes
        diff = _verify_under_torchrun(tp * pp, argv)
        if diff is None:
            return 1
    else:
        diff = verify(spec, args.hf_dir, ckpt_dir, tp, pp, args.batch_size, args.seq_length,
                      args.seed)
        if args.result_file:
            if launch.rank == 0:
                write_result(args.result_file, diff)
            return 0
    ok = diff <= args.atol
    if launch.rank == 0:
        print(f"max |logits difference| megatron (TP={tp}, PP={pp}) vs Hugging Face: "
              f"{diff:.3e} on {args.batch_size}x{args.seq_length} random tokens, FP32 -> "
              f"{'OK' if ok else 'FAIL'} (atol {args.atol:g})", flush=True)
    return 0 if ok else 1


COMMANDS = {"hf-to-megatron": _hf_to_megatron, "megatron-to-hf": _megatron_to_hf,
            "verify": _verify}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; bad input -> ``error:`` line on stderr, exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, argv)
    except UsageError as exc:
        if resolve_launch().rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":  # torchrun children and `python -m megatron_ext.convert.cli`
    sys.exit(main())
