"""``plot_precision.py gnmr``: a synthetic trace (a resumed run's repeated steps, a skipped
step, an excess-comparison run) read back value for value, a whole PNG with the promotion
raster in it, and bad traces refused with one line."""

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.viz.inputs import load_gnmr_trace
from megatron_ext.viz.traces import RASTER_COLORS, promotions
from test_plot_precision import check_png, colour_share, plot

UNITS = ("L0", "L1", "L2")
# high after each step, per unit (step 1..8); step 5 is skipped (non-finite)
HIGH = {"L0": "00110000", "L1": "01111100", "L2": "00001111"}


def _line(step: int, scale: float = 1.0) -> dict:
    if step == 5:
        return {"step": 5, "nonfinite": True, "units": {
            u: {"norm": None, "agnm": 1.0, "gnmr": None, "dgnmr": None,
                "high": HIGH[u][4] == "1", "lock": 2} for u in UNITS}}
    return {"step": step, "alpha": 0.5 if step > 2 else 1.0, "beta": 0.4, "units": {
        u: {"norm": scale * (i + 1) * step, "agnm": 1.0, "gnmr": scale * (1 + 0.1 * i * step),
            "dgnmr": 1.0 + 0.01 * step, "high": HIGH[u][step - 1] == "1", "lock": 0}
        for i, u in enumerate(UNITS)}}


@pytest.fixture
def run(tmp_path) -> Path:
    (tmp_path / "run" / "gnmr").mkdir(parents=True)
    # a first attempt to step 7, then a resume from a checkpoint at 5 rewrites steps 6 and 7
    lines = [*map(_line, range(1, 6)), _line(6, 9.0), _line(7, 9.0), *map(_line, range(6, 9))]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 9, "uni'
    (tmp_path / "run" / "gnmr" / "trace.jsonl").write_text(text)  # a partial last line
    (tmp_path / "run" / "args.json").write_text(json.dumps({"gnmr_compare": "excess"}))
    return tmp_path / "run"


def test_trace_is_read_value_for_value(run):
    trace = load_gnmr_trace(str(run))
    assert trace.steps == tuple(range(1, 9)) and trace.units == UNITS
    assert trace.nonfinite == (5,) and trace.compare == "excess"
    for t in trace.steps:  # the last line of each step won: scale 1 everywhere
        for i, u in enumerate(UNITS):
            norm, gnmr = trace.values["norm"][i, t - 1], trace.values["gnmr"][i, t - 1]
            if t == 5:
                assert np.isnan(norm) and np.isnan(gnmr)
            else:
                assert (norm, gnmr) == ((i + 1) * t, 1 + 0.1 * i * t)
            assert trace.high[i, t - 1] == (HIGH[u][t - 1] == "1")
    assert np.isnan(trace.alpha[4]) and trace.alpha[:2].tolist() == [1.0, 1.0]
    assert promotions(trace.high) == 3  # by hand: each unit switches up once


def test_promotions_count_switches_up():
    high = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [0, 1, 0, 1]], dtype=bool)
    assert promotions(high) == 4


def test_figure_shows_the_raster(run, tmp_path, capsys):
    out = tmp_path / "gnmr.png"
    assert plot("gnmr", run, "--out", out) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    check_png(out, colours=RASTER_COLORS)
    same = tmp_path / "same.png"  # the trace file itself gives the same figure
    assert plot("gnmr", run / "gnmr" / "trace.jsonl", "--out", same) == 0
    assert same.read_bytes() == out.read_bytes()
    # 11 of 24 unit-steps high: the raster's red roughly 11/13 of its grey
    assert colour_share(out, RASTER_COLORS[1]) > 0.5 * colour_share(out, RASTER_COLORS[0])


@pytest.mark.parametrize("text, message", [
    ("", "has no GNMR trace lines"),
    ('{"step": 1, "units": {}}\n', "step 1 is not a GNMR trace line"),
    ('{"step": 1, "units": {"L0": {"high": true}}}\n{"step": 2, "units": {"L1": {"high": '
     'true}}}\n', "step 2 is not a GNMR trace line of the same units"),
    ('{"step": 1, "units": {"L0": {"high": "yes"}}}\n', "unit L0: need an object with"),
    ('{"step": 1, "units": {"L0": {"high": true, "gnmr": "big"}}}\n', "expected a number"),
])
def test_bad_trace_is_one_line_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    assert plot("gnmr", path, "--out", tmp_path / "x.png") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not list(tmp_path.glob("*.png"))
