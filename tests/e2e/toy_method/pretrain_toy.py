"""pretrain_llama.py with the toy method added to the default extensions."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_ext.defaults import default_extensions  # noqa: E402
from megatron_ext.training.pretrain import main  # noqa: E402
from toy_method import toy_extension  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("llama", extensions=default_extensions(toy_extension)))
