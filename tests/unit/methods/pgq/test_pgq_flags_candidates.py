"""``--pgq-candidates``: the recipe's format alone by default, every candidate with ``all``."""

import argparse

import pytest

from megatron_ext.errors import UsageError
from megatron_ext.methods.pgq.flags import candidates
from megatron_ext.methods.pgq.sqnr import CANDIDATES


def _args(fmt="int8", cands=None):
    return argparse.Namespace(pgq_format=fmt, pgq_candidates=cands)


def test_default_profiles_the_recipes_format_alone():
    assert candidates(_args("nvfp4")) == {"nvfp4": CANDIDATES["nvfp4"]}
    assert list(candidates(_args("fp8", "all"))) == list(CANDIDATES)
    assert list(candidates(_args("fp8", "int8, fp8,int8"))) == ["int8", "fp8"]
    with pytest.raises(UsageError, match="is not among --pgq-candidates"):
        candidates(_args("fp4", "int8"))
