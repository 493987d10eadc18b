"""A damaged model.safetensors is one line naming it, not a safetensors traceback."""

import pytest
import torch
from safetensors.torch import save_file

from megatron_ext.convert.hf_files import SINGLE_FILE, HFCheckpoint
from megatron_ext.errors import UsageError


@pytest.mark.parametrize("keep", [0.5, 20])
def test_truncated_safetensors_is_one_line(tmp_path, keep):
    path = tmp_path / SINGLE_FILE
    save_file({"a": torch.ones(1000), "b": torch.ones(10)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(UsageError, match=r"^--hf-dir: cannot read '.*model.safetensors': .*"
                                         r"\(truncated or not a safetensors file\?\)$"):
        HFCheckpoint(str(tmp_path))
