#!/usr/bin/env python
"""Tokenize a JSONL file into Megatron ``.bin``/``.idx`` datasets (Megatron-LM compatible flags).

Example:
    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/docs \\
        --tokenizer-model tokenizer.json --json-keys text --append-eod --workers 2
    # -> data/docs_text_document.bin, data/docs_text_document.idx

Errors (missing input, bad JSON line, missing key, an output that cannot be written) print
one ``error:`` line and exit 2; no partial output is left behind. The logic lives in ``megatron_ext.data.preprocess``.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from megatron_ext.errors import UsageError, run_cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="JSON-lines file, one object per line")
    parser.add_argument(
        "--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx"
    )
    parser.add_argument(
        "--tokenizer-model",
        default="byte",
        help="path of a tokenizers tokenizer.json, or 'byte' (default) for the byte tokenizer",
    )
    parser.add_argument(
        "--eod-token",
        default=None,
        help="the tokenizer.json's end-of-document token, e.g. '</s>' (default: the eos_token "
        "of a tokenizer_config.json beside it, else the first of <|endoftext|> "
        "<|end_of_text|> </s> <eos> it has)",
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)"
    )
    parser.add_argument("--append-eod", action="store_true", help="end each document with EOD")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    parser.add_argument(
        "--log-interval", type=float, default=2.0, help="seconds between progress lines"
    )
    return parser.parse_args(argv)


def _run(argv: list[str]) -> None:
    args = parse_args(argv)
    config = PreprocessConfig(
        input=args.input,
        output_prefix=args.output_prefix,
        tokenizer_model=args.tokenizer_model,
        eod_token=args.eod_token,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        workers=args.workers,
        log_interval=args.log_interval,
    )
    try:
        preprocess(config)
    except FileNotFoundError as err:  # PreprocessError is a ValueError: run_cli reports it
        raise UsageError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    return run_cli(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
