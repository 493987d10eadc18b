"""The STQuant extension's per-step hook: metrics on logged steps only."""

from types import SimpleNamespace

from megatron_ext.methods.stquant.extension import StquantRun


def test_metrics_are_made_on_logged_steps_only():
    calls = []
    optimizer = SimpleNamespace(allocator=SimpleNamespace(updated_at=0, step=3),
                                metrics=lambda: calls.append(1) or {"stquant_avg_bits": 6.0})
    stquant = StquantRun()
    stquant.config = object()  # on
    quiet = SimpleNamespace(optimizer=optimizer, step_result={"logged": False})
    logged = SimpleNamespace(optimizer=optimizer, step_result={"logged": True})
    assert stquant.on_step(None, quiet, None) is None and not calls
    assert stquant.on_step(None, logged, None) == {"stquant_avg_bits": 6.0} and calls == [1]
