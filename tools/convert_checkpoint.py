"""Convert checkpoints between Hugging Face (Llama, GPT-2) and megatron_ext (docs/convert.md).

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir HF --out CKPT \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    python tools/convert_checkpoint.py verify --hf-dir HF --load CKPT \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    python tools/convert_checkpoint.py megatron-to-hf --load CKPT --out HF2

See `python tools/convert_checkpoint.py <command> --help` for every flag.
"""

import sys

from megatron_ext.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
