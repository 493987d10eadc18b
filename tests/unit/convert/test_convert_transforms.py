"""Each transform is lossless, and the fused QKV has megatron's per-group row order."""

import pytest
import torch

from megatron_ext.convert import transforms as T

HEAD_DIM, HIDDEN = 4, 8


def _roundtrip(transform, inputs):
    back = transform.to_hf(transform.to_megatron(inputs))
    assert len(back) == len(inputs)
    for a, b in zip(inputs, back):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _rows(heads):  # weights with random values, one head = HEAD_DIM rows
    return torch.randn(heads * HEAD_DIM, HIDDEN)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (8, 1)])
def test_qkv_round_trip_weights_and_biases(heads, groups):
    transform = T.qkv(groups, HEAD_DIM)
    _roundtrip(transform, [_rows(heads), _rows(groups), _rows(groups)])
    _roundtrip(transform, [torch.randn(heads * HEAD_DIM), torch.randn(groups * HEAD_DIM),
                           torch.randn(groups * HEAD_DIM)])


def _labelled(kind: int, heads: int) -> torch.Tensor:
    """Every row of head h holds ``kind * 100 + h``."""
    return torch.tensor([[kind * 100 + h] for h in range(heads) for _ in range(HEAD_DIM)],
                        dtype=torch.float32)


def test_qkv_rows_are_grouped_per_query_group():
    """Row block order [q heads of group g; k_g; v_g] -- what megatron's attention splits."""
    heads, groups = 4, 2
    fused = T.qkv(groups, HEAD_DIM).to_megatron([_labelled(1, heads), _labelled(2, groups),
                                                 _labelled(3, groups)])
    blocks = fused[::HEAD_DIM, 0].tolist()  # one label per head-sized row block
    assert blocks == [100, 101, 200, 300, 102, 103, 201, 301]


def test_packed_qkv_matches_separate_projections():
    q, k, v = _rows(4), _rows(4), _rows(4)
    packed = T.packed_qkv(4, HEAD_DIM).to_megatron([torch.cat([q, k, v])])
    assert torch.equal(packed, T.qkv(4, HEAD_DIM).to_megatron([q, k, v]))
    _roundtrip(T.packed_qkv(4, HEAD_DIM), [torch.cat([q, k, v])])


def test_conv1d_weight_is_transposed_then_fused():
    conv1d = torch.randn(HIDDEN, 3 * 4 * HEAD_DIM)  # GPT-2 c_attn: [in, 3 * out]
    transform = T.compose(T.TRANSPOSE, T.packed_qkv(4, HEAD_DIM))
    assert torch.equal(transform.to_megatron([conv1d]),
                       T.packed_qkv(4, HEAD_DIM).to_megatron([conv1d.t()]))
    _roundtrip(transform, [conv1d])


def test_vocab_padding_adds_zero_rows_and_checks_the_vocab_size():
    embedding = torch.randn(300, HIDDEN, dtype=torch.bfloat16)
    padded = T.pad_rows(300, 384).to_megatron([embedding])
    assert padded.shape == (384, HIDDEN) and not padded[300:].any()
    _roundtrip(T.pad_rows(300, 384), [embedding])
    with pytest.raises(ValueError, match="vocab_size is 256"):
        T.pad_rows(256, 384).to_megatron([embedding])


def test_swiglu_halves_and_identity():
    gate, up = _rows(6), _rows(6)
    assert torch.equal(T.concat_rows(2).to_megatron([gate, up])[:6 * HEAD_DIM], gate)
    _roundtrip(T.concat_rows(2), [gate, up])
    _roundtrip(T.IDENTITY, [gate])


def test_transforms_work_on_meta_tensors():
    """Shape checks run transforms on data-less tensors before anything is read."""
    meta = [torch.empty(n * HEAD_DIM, HIDDEN, device="meta") for n in (4, 2, 2)]
    assert T.qkv(2, HEAD_DIM).to_megatron(meta).shape == (8 * HEAD_DIM, HIDDEN)
    with pytest.raises(RuntimeError):
        T.qkv(3, HEAD_DIM).to_megatron(meta)
