"""The tiny models, converted once per test session."""

import pytest
from unit.convert.hf_models import convert_model


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """Callable: converted(name) -> (HF dir, megatron checkpoint dir) of hf_models.MODELS[name]."""
    root = tmp_path_factory.mktemp("converted")
    return lambda name: convert_model(name, root)
