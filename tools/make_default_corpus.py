#!/usr/bin/env python
"""Build the embedded default corpus (Python stdlib sources -> BPE tokenizer -> .bin/.idx).

Example:
    python tools/make_default_corpus.py                   # into the default cache directory
    python tools/make_default_corpus.py --out /data/stdlib --vocab-size 8192 --max-docs 200

If DIR already holds a finished corpus it is reused, not rebuilt. The recipe is documented in
``megatron_ext.data.corpus`` and docs/data.md.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.data.corpus import (  # noqa: E402
    DEFAULT_VOCAB_SIZE,
    default_corpus_dir,
    materialize_corpus,
)
from megatron_ext.errors import UsageError, run_cli  # noqa: E402
from megatron_ext.io import check_output  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="output directory (default: the cache directory ensure_default_corpus uses)",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="BPE vocabulary size"
    )
    parser.add_argument(
        "--max-docs", type=int, default=None, help="use only the first N stdlib files"
    )
    return parser.parse_args(argv)


def _run(argv: list[str]) -> None:
    args = parse_args(argv)
    out = args.out or default_corpus_dir(None, args.max_docs, args.vocab_size)
    check_output(out, "--out")
    start = time.monotonic()
    try:
        corpus = materialize_corpus(out, args.vocab_size, args.max_docs)
    except FileExistsError as err:
        raise UsageError(str(err)) from None
    print(
        f"corpus ready ({time.monotonic() - start:.1f}s): {corpus.num_docs} docs, "
        f"{corpus.num_tokens} tokens\n  data prefix: {corpus.data_prefix}\n"
        f"  tokenizer:   {corpus.tokenizer_json}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    """Build (or find) the corpus; bad input -> one ``error:`` line and exit status 2."""
    return run_cli(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
