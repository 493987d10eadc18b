"""benchmarks/train_throughput.py: the median comes with its spread and the number of timed
steps, and too few timed steps draw a warning."""

import importlib.util
import statistics

import pytest

from pretrain_runner import REPO


def _bench():
    spec = importlib.util.spec_from_file_location(
        "train_throughput", REPO / "benchmarks" / "train_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_has_the_median_and_the_quartiles_of_the_timed_steps():
    times = [0.2, 0.21, 0.19, 8.6, 0.2, 0.22, 0.18, 0.2]  # one step 43x slower (a busy moment)
    got = _bench().summarize(times, [1000.0] * len(times))
    ms = sorted(1e3 * t for t in times)
    assert got["timed_steps"] == 8 and got["step_time_ms"] == pytest.approx(200.0)
    assert (got["step_time_min_ms"], got["step_time_max_ms"]) == pytest.approx((180.0, 8600.0))
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    assert (got["step_time_p25_ms"], got["step_time_p75_ms"]) == pytest.approx((q1, q3))
    assert 190 <= q1 <= q3 <= 220  # the outlier moves neither quartile


def test_few_timed_steps_are_warned_about():
    bench = _bench()
    assert "only 1 timed step " in bench.few_steps_warning(6, 5)
    assert f"--steps {5 + bench.MIN_TIMED}" in bench.few_steps_warning(6, 5)
    assert bench.few_steps_warning(5 + bench.MIN_TIMED, 5) is None


def test_bad_warmup_is_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        _bench().parse_args(["--steps", "5", "--warmup", "5"])
    assert info.value.code == 2 and "--warmup" in capsys.readouterr().err
