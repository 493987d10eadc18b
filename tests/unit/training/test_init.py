"""Layout-invariant initialisation, checked in one process against an independent draw."""

import pytest
import torch

from megatron_ext.training import init


def test_stream_seed_is_deterministic_and_key_sensitive():
    a = init._stream_seed(1, "decoder.layers.self_attention.linear_qkv.weight", (3,))
    assert a == init._stream_seed(1, "decoder.layers.self_attention.linear_qkv.weight", (3,))
    assert a != init._stream_seed(1, "decoder.layers.self_attention.linear_qkv.weight", (4,))
    assert a != init._stream_seed(2, "decoder.layers.self_attention.linear_qkv.weight", (3,))


class _Config:
    init_method = staticmethod(lambda t, generator=None: t.normal_(0, 0.02, generator=generator))
    output_layer_init_method = staticmethod(
        lambda t, generator=None: t.normal_(0, 0.005, generator=generator))


def _shard(key, full_shape, offset, local_shape, prepend=()):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    return ShardedTensor(key=key, data=torch.zeros(local_shape), dtype=torch.float32,
                         local_shape=local_shape, global_shape=(*[8] * len(prepend), *full_shape),
                         global_offset=(*prepend, *offset), axis_fragmentations=None,
                         prepend_axis_num=len(prepend))


@pytest.mark.parametrize("key,std", [("decoder.layers.mlp.linear_fc1.weight", 0.02),
                                     ("decoder.layers.mlp.linear_fc2.weight", 0.005)])
def test_two_shards_reassemble_the_unsharded_draw(key, std):
    full = _shard(key, (64, 32), (0, 0), (64, 32), prepend=(2,))
    top = _shard(key, (64, 32), (0, 0), (32, 32), prepend=(2,))
    bottom = _shard(key, (64, 32), (32, 0), (32, 32), prepend=(2,))
    for sh in (full, top, bottom):
        init._redraw(sh, _Config, seed=5)
    assert torch.equal(torch.cat([top.data, bottom.data]), full.data)
    assert full.data.std().item() == pytest.approx(std, rel=0.1)
    other_layer = _shard(key, (64, 32), (0, 0), (64, 32), prepend=(3,))
    init._redraw(other_layer, _Config, seed=5)
    assert not torch.equal(other_layer.data, full.data)
