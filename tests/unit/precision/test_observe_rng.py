"""An observed pass leaves the run's random streams as they were: torch's default generator and
megatron's model-parallel RNG tracker (what dropout inside TP regions draws from)."""

import torch
from megatron.core import tensor_parallel

from megatron_ext.precision.observe import isolated_rng
from precision_helpers import megatron_world  # noqa: F401  (fixture)


def _draws(with_observed_pass: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed everything, optionally run a block that draws from both streams inside
    ``isolated_rng``, then draw from both."""
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if with_observed_pass:
        with isolated_rng(99):
            torch.rand(5)
            with tracker.fork():
                torch.rand(5)  # dropout in an observed pass
    with tracker.fork():
        tracked = torch.rand(4)
    return torch.rand(4), tracked


def test_observed_pass_leaves_both_streams_untouched(megatron_world):  # noqa: F811
    plain, plain_tracked = _draws(False)
    after, after_tracked = _draws(True)
    assert torch.equal(plain, after)
    assert torch.equal(plain_tracked, after_tracked)


def test_inside_the_block_the_stream_is_the_given_seed(megatron_world):  # noqa: F811
    torch.manual_seed(0)
    with isolated_rng(99):
        inside = torch.rand(3)
    torch.manual_seed(99)
    assert torch.equal(inside, torch.rand(3))
