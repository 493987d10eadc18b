"""plot_precision.py stquant: STQuant's widths per layer over training (paper Fig. 6a)."""

import json

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from megatron_ext.defaults import plot_main as main
from megatron_ext.viz.inputs import load_widths
from megatron_ext.viz.widths import WIDTH_COLORS, short_name

LAYERS = ["output_layer.weight", "decoder.layers.mlp.linear_fc1.weight[1]",
          "embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight[0]"]


def _write(run, lines):
    run.mkdir()
    with open(run / "stquant_widths.jsonl", "w") as f:
        for step, bits in lines:
            f.write(json.dumps({"step": step, "widths": dict(zip(LAYERS, bits))}) + "\n")


def test_reader_and_names(tmp_path):
    _write(tmp_path / "run", [(1, [8, 4, 8, 16]), (10, [8, 4, 4, 8]), (10, [32, 4, 4, 8])])
    history = load_widths(str(tmp_path / "run"))
    assert history.steps == (1, 10)  # the later line of step 10 wins
    assert history.bits.tolist() == [[8, 32], [4, 4], [8, 4], [16, 8]]
    assert [short_name(n) for n in LAYERS] == ["output", "L1.fc1", "embedding", "L0.qkv"]


def test_plot_is_written_with_every_width_colour(tmp_path, capsys):
    _write(tmp_path / "run", [(1, [32, 4, 8, 16]), (50, [32, 4, 8, 16])])
    out = tmp_path / "w.png"
    assert main(["stquant", str(tmp_path / "run"), "--out", str(out)]) == 0
    image = imread(out)[..., :3]
    for color in WIDTH_COLORS.values():
        assert np.isclose(image, to_rgb(color), atol=2 / 255).all(axis=-1).sum() > 100


def test_bad_widths_file_is_one_line(tmp_path, capsys):
    _write(tmp_path / "run", [(1, [8, 4, 5, 16])])
    assert main(["stquant", str(tmp_path / "run"), "--out", str(tmp_path / "w.png")]) == 2
    assert "is not a width line" in capsys.readouterr().err
    assert not (tmp_path / "w.png").exists()


def test_rows_in_model_order_and_the_last_change_drawn_one_interval_wide(tmp_path):
    from megatron_ext.viz.widths import width_history

    layers = [f"decoder.layers.{p}.weight[{layer}]" for layer in (1, 0) for p in
              ("mlp.linear_fc2", "self_attention.linear_proj", "mlp.linear_fc1",
               "self_attention.linear_qkv")] + ["output_layer.weight"]
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "stquant_widths.jsonl", "w") as f:  # every 10 steps; all 4 bits at 40
        for step in (0, 10, 20, 30, 40):
            f.write(json.dumps({"step": step, "widths": {n: 4 if step == 40 else 32
                                                         for n in layers}}) + "\n")
    fig = width_history(load_widths(str(run)))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "L0.qkv", "L0.proj", "L0.fc1", "L0.fc2", "L1.qkv", "L1.proj", "L1.fc1", "L1.fc2",
        "output"]
    codes = ax.images[0].get_array()
    assert codes.shape[1] == 50  # steps 0..49: the step-40 widths hold for 10 steps
    assert (codes[:, 40:] == 0).all() and (codes[:, :40] == 3).all()
