"""The tensor-core GEMM (interpret mode) against the reference ops, at row counts, column counts and
depths that are not multiples of the tiles, with the layer index, bias, split-K and each epilogue: as
the batched-decode GEMM (every row in one tile).

Tolerances: float32 1e-5 relative (same products, another summation order); bfloat16 1e-2 relative
(outputs round to bf16, ~4e-3 per element, and a different summation order can flip a rounding).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxinfer.ops import LayerWeight, reference
from jaxinfer.pallas import tables
from jaxinfer.pallas.skinny_gemm import SkinnyConfig, choose_config, fit_stages, skinny_gemm, table_config

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# (M, N, K, config): ragged everywhere; exact tiles; split-K with a ragged last share; M at a tile edge
CASES = [
    (3, 100, 72, SkinnyConfig(block_n=32, block_k=32)),
    (16, 128, 256, SkinnyConfig(block_n=64, block_k=64, split_k=1)),
    (5, 96, 200, SkinnyConfig(block_n=32, block_k=32, split_k=3)),
    (17, 64, 128, SkinnyConfig(block_n=16, block_k=64, split_k=2)),
    (64, 48, 160, SkinnyConfig(block_n=16, block_k=32, split_k=2)),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("kind", ["plain", "bias", "residual", "swiglu"])
def test_skinny_gemm_matches_reference(kind, case, dtype):
    M, N, K, cfg = CASES[case]
    keys = jax.random.split(jax.random.PRNGKey(hash((kind, case, str(dtype))) % 2**31), 4)
    L, layer = 3, 2
    x = jax.random.normal(keys[0], (M, K), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (L, N, K), jnp.float32) / np.sqrt(K)).astype(dtype)
    b = jax.random.normal(keys[2], (L, N), jnp.float32).astype(dtype)
    res = jax.random.normal(keys[3], (M, N), jnp.float32).astype(dtype)
    lw, lb = LayerWeight(w, jnp.int32(layer)), LayerWeight(b, jnp.int32(layer))
    kw = dict(config=cfg, interpret=True)
    if kind == "plain":
        y, ref = skinny_gemm(x, w, layer, **kw), reference.linear(x, lw)
    elif kind == "bias":
        y, ref = skinny_gemm(x, w, layer, b=b, **kw), reference.linear(x, lw, lb)
    elif kind == "residual":
        y = skinny_gemm(x, w, layer, b=b, residual=res, epilogue="residual", **kw)
        ref = reference.linear_residual(x, lw, lb, res)
    else:
        y = skinny_gemm(x, w, layer, epilogue="swiglu", **kw)
        ref = reference.swiglu(reference.linear(x, lw))
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("split_k", [1, 2])
def test_a_bias_at_its_own_layer(split_k):
    """model.split_layers: a one-layer matrix stack (layer 0) with its bias in the stacked [L, N] array at
    vector_layer 2 (both the fused epilogue and split-K's XLA epilogue)."""
    M, N, K = 5, 96, 128
    keys = jax.random.split(jax.random.PRNGKey(split_k), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.float32)
    w = jax.random.normal(keys[1], (1, N, K), jnp.float32) / np.sqrt(K)
    b = jax.random.normal(keys[2], (3, N), jnp.float32)
    cfg = SkinnyConfig(block_n=32, block_k=32, split_k=split_k)
    y = skinny_gemm(x, w, 0, b=b, vector_layer=2, config=cfg, interpret=True)
    ref = reference.linear(x, LayerWeight(w, jnp.int32(0)), LayerWeight(b, jnp.int32(2)))
    assert rel_err(y, ref) <= 1e-5


def test_two_dimensional_weight_and_default_config():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 256), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (192, 256), jnp.float32)
    y = skinny_gemm(x, w, interpret=True)
    assert rel_err(y, reference.linear(x, w)) <= 1e-5


def test_choose_config_splits_narrow_matrices_only():
    assert choose_config(64, 28672, 4096, "swiglu").split_k == 1     # 224 column blocks already
    assert choose_config(64, 4096, 14336).split_k > 1                # 64 column blocks: split K


def test_table_covers_measured_shapes_only():
    assert table_config(8, 6144, 2560) == table_config(16, 6144, 2560) is not None
    assert table_config(64, 19456, 2560, "swiglu") is None           # XLA measured faster there
    assert table_config(65, 6144, 2560) is None                      # above MAX_T: XLA
    assert table_config(8, 4096, 4096, "residual") is None           # not swept


def test_a_32_row_entry_serves_17_to_32_rows_only(monkeypatch):
    cfg32 = SkinnyConfig(block_n=32, block_k=256)
    monkeypatch.setitem(tables.SKINNY_GEMM, (6144, 2560, "none", 32), cfg32)
    assert table_config(16, 6144, 2560) == tables.SKINNY_GEMM[(6144, 2560, "none", 16)]
    assert table_config(17, 6144, 2560) == table_config(32, 6144, 2560) == cfg32
    assert table_config(33, 6144, 2560) == tables.SKINNY_GEMM[(6144, 2560, "none", 64)]
    assert table_config(32, 2560, 4096, "residual") == tables.SKINNY_GEMM[(2560, 4096, "residual", 64)]   # 64's


def test_stages_fit_shared_memory():
    big = SkinnyConfig(block_n=64, block_k=256, num_stages=4)
    assert fit_stages(big, 64, 2, "swiglu").num_stages < 4           # 384 KB asked for on the H200
    assert fit_stages(big, 16, 2, "none").num_stages == 4


@pytest.mark.parametrize("bad", [dict(epilogue="gelu"), dict(epilogue="residual"),
                                 dict(config=SkinnyConfig(block_n=48))])
def test_bad_arguments_are_refused(bad):
    x, w = jnp.zeros((4, 64)), jnp.zeros((32, 64))
    with pytest.raises(ValueError):
        skinny_gemm(x, w, interpret=True, **bad)


def test_more_rows_than_max_t_are_refused():
    with pytest.raises(ValueError, match="MAX_T"):
        skinny_gemm(jnp.zeros((65, 64)), jnp.zeros((32, 64)), interpret=True)
