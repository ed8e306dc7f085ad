"""The split-K finish fused with the RMSNorm after it (pallas/residual_norm.py, interpret mode) against its
twin (the XLA ops it replaces), and the op that uses it (ops.pallas's linear_residual_norm_swiglu) against
the reference ops: widths that are and are not powers of two, one to many partials, the norm's scale read
at its own layer of a stack.

Tolerances: float32 1e-6 relative (the same sums; the mean of squares in another order); bfloat16 1e-2
(outputs round to bf16, and a reordered sum can flip a rounding).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxinfer.ops import LayerWeight, get_ops, reference, twins
from jaxinfer.pallas import residual_norm
from jaxinfer.pallas.skinny_gemm import SkinnyConfig, skinny_gemm

TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}
CASES = [(2, 3, 100), (4, 8, 256), (3, 17, 2560), (1, 1, 48), (8, 5, 96)]   # (S, M, N)


def _inputs(S, M, N, dtype, seed, L=3):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    partials = jax.random.normal(keys[0], (S, M, N), jnp.float32)
    residual = (3 * jax.random.normal(keys[1], (M, N), jnp.float32)).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(keys[2], (L, N), jnp.float32)).astype(dtype)
    return partials, residual, scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_its_twin(case, dtype):
    S, M, N = CASES[case]
    partials, residual, scale = _inputs(S, M, N, dtype, seed=case + 10 * (dtype == jnp.bfloat16))
    r, h = residual_norm.split_k_residual_rms_norm(partials, residual, scale, 1e-6, 2, interpret=True)
    r_ref, h_ref = twins.split_k_residual_rms_norm(partials, residual, scale, 1e-6, 2)
    for y, ref in ((r, r_ref), (h, h_ref)):
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert rel_err(y, ref) <= TOL[dtype]
    # the scale's layer matters: layer 0 gives other normed rows
    assert rel_err(h, twins.split_k_residual_rms_norm(partials, residual, scale, 1e-6, 0)[1]) > 10 * TOL[dtype]


def test_twin_is_the_ops_it_replaces():
    """The twin is the split-K finish of skinny_gemm and then reference.rms_norm, as the unfused path runs."""
    M, N, K = 6, 96, 512
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    x = jax.random.normal(keys[0], (M, K), jnp.float32)
    w = jax.random.normal(keys[1], (1, N, K), jnp.float32) / np.sqrt(K)
    res = jax.random.normal(keys[2], (M, N), jnp.float32)
    scale = jax.random.normal(keys[3], (N,), jnp.float32)
    cfg = SkinnyConfig(block_n=32, block_k=64, split_k=4)
    partials = skinny_gemm(x, w, config=cfg, finish=False, interpret=True)
    assert partials.shape == (4, M, N) and partials.dtype == jnp.float32
    r_ref, h_ref = twins.split_k_residual_rms_norm(partials, res, scale, 1e-6)
    r = skinny_gemm(x, w, residual=res, epilogue="residual", config=cfg, interpret=True)
    assert rel_err(r, r_ref) <= 1e-6
    assert rel_err(h_ref, reference.rms_norm(r, scale, 1e-6)) <= 1e-6
    assert rel_err(r, reference.linear_residual(x, w[0], None, res)) <= 1e-5


def test_bad_shapes_and_partials_with_an_epilogue():
    partials, residual, scale = _inputs(2, 3, 64, jnp.float32, seed=0)
    with pytest.raises(ValueError, match="disagree"):
        residual_norm.split_k_residual_rms_norm(partials, residual[:, :32], scale, 1e-6, interpret=True)
    x, w = jnp.ones((3, 128)), jnp.ones((64, 128))
    with pytest.raises(ValueError, match="finish=False"):
        skinny_gemm(x, w, residual=jnp.ones((3, 64)), epilogue="residual", finish=False, interpret=True)


def _uses_fused_kernel(fn, *args) -> bool:
    return "split_k_residual_rms_norm" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("split_layer", [False, True], ids=["stacked", "split"])
def test_op_matches_reference(split_layer, dtype):
    """A decode batch (8 rows) through the op: the split-K output projection's finish and the MLP norm fused,
    then gate/up + SwiGLU, against reference.linear_residual then reference.rms_norm_swiglu. `split`: the
    matrices are one-layer stacks (model.split_layers) and the norm's scale is read at layer 2 of its stack."""
    M, D, Q, I, L = 8, 128, 1024, 96, 3
    keys = jax.random.split(jax.random.PRNGKey(7 + split_layer), 5)
    attn = jax.random.normal(keys[0], (M, Q), jnp.float32).astype(dtype)
    x = jax.random.normal(keys[1], (M, D), jnp.float32).astype(dtype)
    wo = (jax.random.normal(keys[2], (L, D, Q), jnp.float32) / np.sqrt(Q)).astype(dtype)
    wgu = (jax.random.normal(keys[3], (L, 2 * I, D), jnp.float32) / np.sqrt(D)).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(keys[4], (L, D), jnp.float32)).astype(dtype)
    if split_layer:
        lw, lgu = LayerWeight(wo[2:3], jnp.int32(0)), LayerWeight(wgu[2:3], jnp.int32(0))
    else:
        lw, lgu = LayerWeight(wo, jnp.int32(2)), LayerWeight(wgu, jnp.int32(2))
    ls = LayerWeight(scale, jnp.int32(2))
    ops = get_ops("pallas-interpret")
    fused = jax.jit(lambda a, r: ops.linear_residual_norm_swiglu(a, lw, None, r, ls, 1e-6, lgu))
    assert _uses_fused_kernel(fused, attn, x), "the fused kernel was not taken"
    r, h = fused(attn, x)
    r_ref, h_ref = reference.linear_residual_norm_swiglu(attn, lw, None, x, ls, 1e-6, lgu)
    assert r.dtype == r_ref.dtype and h.shape == h_ref.shape == (M, I)
    assert rel_err(r, r_ref) <= (1e-5 if dtype == jnp.float32 else 1e-2)
    assert rel_err(h, h_ref) <= (1e-5 if dtype == jnp.float32 else 2e-2)


def test_op_takes_the_two_ops_where_nothing_splits():
    """One row (the batch-1 GEMV path) and a projection too shallow to split go the unfused way."""
    ops = get_ops("pallas-interpret")
    D, Q, I = 64, 128, 32
    wo, wgu = jnp.ones((D, Q)) / Q, jnp.ones((2 * I, D)) / D
    for M in (1, 4):
        fn = jax.jit(lambda a, r: ops.linear_residual_norm_swiglu(a, wo, None, r, jnp.ones((D,)), 1e-6, wgu))
        a, r = jnp.ones((M, Q)), jnp.ones((M, D))
        assert not _uses_fused_kernel(fn, a, r)
        r_out, h = fn(a, r)
        r_ref, h_ref = reference.linear_residual_norm_swiglu(a, wo, None, r, jnp.ones((D,)), 1e-6, wgu)
        assert rel_err(r_out, r_ref) <= 1e-5 and rel_err(h, h_ref) <= 1e-5


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("case", [1, 2, 4])
def test_normed_rows_quantized_for_a_w8a8_product(case, fmt):
    """quantize_to: the same residual rows, and the normed rows as quantize_rows quantizes the kernel's own normed rows
    (bit for bit: one row's arithmetic, pallas/row_quantize.py's)."""
    from jaxinfer.ops.quantized import FORMATS, MAX_VALUE, quantize_rows

    S, M, N = CASES[case]
    partials, residual, scale = _inputs(S, M, N, jnp.bfloat16, seed=case)
    r, h = residual_norm.split_k_residual_rms_norm(partials, residual, scale, 1e-6, 1, interpret=True)
    r_q, hq, h_scale = residual_norm.split_k_residual_rms_norm(
        partials, residual, scale, 1e-6, 1, quantize_to=(FORMATS[fmt], MAX_VALUE[fmt]), interpret=True)
    want_q, want_scale = quantize_rows(h, FORMATS[fmt])
    np.testing.assert_array_equal(np.asarray(r_q, np.float32), np.asarray(r, np.float32))
    np.testing.assert_array_equal(np.asarray(hq.astype(jnp.float32)), np.asarray(want_q.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(h_scale), np.asarray(want_scale))
    with pytest.raises(ValueError, match="8-bit dtype"):
        residual_norm.split_k_residual_rms_norm(partials, residual, scale, 1e-6, quantize_to=(jnp.bfloat16, 1.0),
                                                interpret=True)
