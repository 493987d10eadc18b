"""Behaviour preserved: SNIP, ``uniform:fp8`` and ``min-rel-err`` runs reproduce the recorded
reference (``reference_runs.py``) — plans exactly, losses bit for bit on the machine kind that
recorded them (other CPU instruction sets may round matmuls differently: 1e-6 relative)."""

from __future__ import annotations

import json

import pytest

from reference_runs import REFERENCE, RUNS, machine, record_run

_REF = json.loads(REFERENCE.read_text())


@pytest.mark.parametrize("name", sorted(RUNS))
def test_reference_run_reproduced(tmp_path, name):
    want = _REF["runs"][name]
    got = record_run(RUNS[name], tmp_path / name)
    assert got["plans"] == want["plans"]
    assert got["fp4_flop_frac"] == want["fp4_flop_frac"]
    if _REF["machine"] == machine():
        assert got["loss"] == want["loss"]
        assert got["grad_norm"] == want["grad_norm"]
    else:
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
