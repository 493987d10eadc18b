"""``--gaussws`` through the real entry point: a short run trains the sampled sites' bit widths
and reports them; a resume between steps reproduces the uninterrupted run bit for bit (the
noise keys come back from the iteration and the run seed, b_i with the model), logging every
second step with the same bit-width statistics there."""

import math

import pytest

from pretrain_runner import FAST_ARGS, launch, read_metrics

ARGS = [*FAST_ARGS, "--gaussws", "od", "--train-iters", "5"]
OD_SITES = [f"L{layer}.{site}" for layer in range(4) for site in ("proj", "fc2")]


def _steps(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def _gaussws(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("gaussws_")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gaussws")
    full, second, plain, ckpt = (tmp / n for n in ("full", "second", "plain", "ckpt"))
    # the uninterrupted run saves at step 2 on its way; the resume starts from that save
    launch([*ARGS, "--run-dir", str(full), "--save", str(ckpt), "--save-interval", "2"])
    # the resume logs every 2nd step: its statistics are made on logged steps only
    launch([*ARGS, "--log-interval", "2", "--run-dir", str(second), "--load",
            str(ckpt / "iter_0000002"), "--no-save"])
    launch([*FAST_ARGS, "--train-iters", "2", "--run-dir", str(plain), "--no-save"])
    return full, second, plain


def test_od_run_trains_and_reports_bit_widths(runs):
    full, _, plain = runs
    steps = _steps(full)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) for r in steps.values())
    assert steps[1]["loss"] != _steps(plain)[1]["loss"]  # the GEMMs saw ŵ, not w
    last = steps[5]
    assert set(_gaussws(last)) == {f"gaussws_b_{s}/{sid}" for sid in OD_SITES
                                   for s in ("mean", "min", "max")}
    for sid in OD_SITES:
        lo, mean, hi = (last[f"gaussws_b_{s}/{sid}"] for s in ("min", "mean", "max"))
        # weight decay alone would move every tile alike: a spread needs eq. 3's gradient
        assert lo < mean < hi and 5.9 < lo and hi < 6.1, (sid, lo, mean, hi)


def test_resume_between_steps_is_bit_for_bit(runs):
    full, second, _ = runs
    reference, resumed = _steps(full), _steps(second)
    assert sorted(resumed) == [4, 5]  # --log-interval 2, and the last step
    for step in (4, 5):
        for key in ("loss", "grad_norm", *_gaussws(reference[step])):
            assert resumed[step][key] == reference[step][key], (step, key)
