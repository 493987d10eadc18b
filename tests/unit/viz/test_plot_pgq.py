"""``plot_precision.py pgq``: the SQNR grid of a profile (values by hand from
``tests/unit/methods/pgq/pgq_synthetic.py``), a whole PNG, one-line errors."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from megatron_ext.defaults import plot_main as main
from megatron_ext.viz.pgq import sqnr_grid

sys.path.insert(0, str(Path(__file__).parents[1] / "methods" / "pgq"))
from pgq_synthetic import synthetic_profile  # noqa: E402


def test_grid_is_layer_by_operand_in_db():
    rows, grid = sqnr_grid(synthetic_profile(), "int8")
    assert rows == ["embedding", "L0.qkv", "L0.proj", "L0.fc1", "L0.fc2", "logits"]
    # columns: fprop.x fprop.w dgrad.dy dgrad.w wgrad.dy wgrad.x
    assert grid[1].tolist() == pytest.approx([20, 30, 10 * math.log10(0.5), 30,
                                              10 * math.log10(2), 20])
    assert np.isnan(grid[0]).tolist() == [True, False, True, True, False, True]
    assert grid[0, 1] == pytest.approx(10 * math.log10(0.06))
    assert grid[2, 2] == math.inf and grid[5, 0] == math.inf  # exact operands


def test_plot_writes_a_png(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(synthetic_profile().to_dict(), allow_nan=False))
    out = tmp_path / "sqnr.png"
    assert main(["pgq", str(profile), "--out", str(out)]) == 0
    image = imread(str(out))
    assert image.shape[0] > 100 and image.shape[1] > 200 and image[..., :3].std() > 0.05
    assert main(["pgq", str(profile), "--out", str(tmp_path / "x.png"),
                 "--formats", "int8,fp8"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --formats fp8: not in")
    (tmp_path / "bad.json").write_text('{"version": 1}')
    assert main(["pgq", str(tmp_path / "bad.json"), "--out", str(tmp_path / "y.png")]) == 2
    assert "not a version-1 PGQ profile" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "y.png").exists()
