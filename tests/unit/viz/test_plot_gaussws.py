"""plot_precision.py gaussws: b_t per site over training (GaussWS paper Fig. 6), from a
generated metrics.jsonl whose values are known by construction."""

import json

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from megatron_ext.methods.gaussws.history import load_bitwidths
from megatron_ext.defaults import plot_main as main

SITES = ["L1.fc2", "L0.proj", "L1.proj", "L0.fc2"]  # not in model order on purpose


def bits_at(step: int, row: int) -> tuple[float, float, float]:
    """(mean, min, max) of site SITES[row] at ``step``: falls from 8 towards 4 + row / 2."""
    mean = 4 + row / 2 + 4 * 0.9 ** step
    return mean, mean - 0.25 - 0.05 * row, mean + 0.5


def write_run(run, steps, extra=()):
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "val_loss": 9.0}) + "\n")  # no b_t: ignored
        for step in steps:
            record = {"step": step, "loss": 8.0 - step / 10}
            for row, sid in enumerate(SITES):
                for stat, value in zip(("mean", "min", "max"), bits_at(step, row)):
                    record[f"gaussws_b_{stat}/{sid}"] = value
            f.write(json.dumps(record) + "\n")
        for record in extra:
            f.write(json.dumps(record) + "\n")


def test_reader_orders_sites_and_keeps_the_last_record_of_a_step(tmp_path):
    resumed = {"step": 20, "gaussws_b_mean/L0.proj": 3.5}  # a resumed run's repeat of step 20
    write_run(tmp_path / "run", range(1, 21), [resumed])
    history = load_bitwidths(str(tmp_path / "run"))
    assert history.sites == ("L0.proj", "L0.fc2", "L1.proj", "L1.fc2")
    assert history.steps == tuple(range(1, 21))
    row = {sid: SITES.index(sid) for sid in history.sites}
    for i, sid in enumerate(history.sites):
        expect = np.array([bits_at(t, row[sid]) for t in range(1, 20)])
        for col, stat in enumerate(("mean", "min", "max")):
            np.testing.assert_allclose(history.bits[stat][i, :19], expect[:, col], rtol=0)
    assert history.final("mean")[0] == 3.5  # the repeat wins ...
    assert np.isnan(history.bits["min"][0, -1])  # ... and has no min: NaN there
    assert history.final("min")[0] == bits_at(19, 1)[1]  # final() falls back to step 19


def test_plot_is_written(tmp_path, capsys):
    write_run(tmp_path / "run", range(1, 31))
    out = tmp_path / "bits.png"
    assert main(["gaussws", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    image = imread(out)[..., :3]
    assert image.shape[0] > 200 and image.shape[1] > 600
    # the end-of-run panel's mean markers (one per site) are drawn
    assert np.isclose(image, to_rgb("#c44e52"), atol=2 / 255).all(axis=-1).sum() > 20


def test_bad_run_dir_is_one_line_and_exit_2(tmp_path, capsys):
    for run, message in [(tmp_path / "missing", "does not exist"),
                         (tmp_path, "has no metrics.jsonl")]:
        assert main(["gaussws", str(run), "--out", str(tmp_path / "b.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text('{"step": 1, "loss": 8.0}\n')
    assert main(["gaussws", str(plain), "--out", str(tmp_path / "b.png")]) == 2
    assert "not a --gaussws run" in capsys.readouterr().err
    assert not (tmp_path / "b.png").exists()
