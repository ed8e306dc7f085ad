"""The attention kernels' table configs (measured at head_dim 128) fitted to wider heads: a K/V pipeline stage holds
no more bytes at head_dim 256 than the table's at 128 (at 256 the prompt kernel's unfitted config asked 286,784 bytes
of the H200's 232,448 of shared memory), and heads of at most 128 keep the table's configs."""

import pytest

from jaxinfer.pallas import decode_attention, prefill_attention, verify_attention
from jaxinfer.pallas.blocks import kv_block_for_head_dim


def _stage_bytes(block_k: int, head_dim: int) -> int:   # one pipeline stage's K and V tiles, bf16
    return 2 * block_k * head_dim * 2


@pytest.mark.parametrize("T", [16, 256, 1024, 8192])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 4), (32, 8)])
def test_prefill_config(T, heads, kv_heads):
    at128 = prefill_attention.choose_config(T, heads, kv_heads, 128)
    at256 = prefill_attention.choose_config(T, heads, kv_heads, 256)
    assert at256.num_stages * _stage_bytes(at256.block_k, 256) <= at128.num_stages * _stage_bytes(at128.block_k, 128)
    assert at256.block_k >= 16
    assert prefill_attention.choose_config(T, heads, kv_heads, 64).block_k == at128.block_k


@pytest.mark.parametrize("batch,span", [(1, 1024), (1, 32768), (8, 4096), (64, 1024), (256, 8192)])
def test_decode_and_verify_configs(batch, span):
    for itemsize, int8 in [(2, False), (1, False), (1, True)]:
        at128 = decode_attention.choose_config(batch, 8, span, itemsize, int8, 128)
        at256 = decode_attention.choose_config(batch, 8, span, itemsize, int8, 256)
        assert at256.num_stages * _stage_bytes(at256.block_k, 256) <= \
            at128.num_stages * _stage_bytes(at128.block_k, 128)
        assert decode_attention.choose_config(batch, 8, span, itemsize, int8) == at128
    v128 = verify_attention.choose_config(16, batch, 8, span, 128)
    v256 = verify_attention.choose_config(16, batch, 8, span, 256)
    assert v256.num_stages * _stage_bytes(v256.block_k, 256) <= v128.num_stages * _stage_bytes(v128.block_k, 128)


def test_kv_block_for_head_dim():
    assert [kv_block_for_head_dim(64, hd) for hd in (64, 96, 128, 192, 256, 512)] == [64, 64, 64, 32, 32, 16]
    assert kv_block_for_head_dim(16, 256) == 16   # never under Triton's 16
