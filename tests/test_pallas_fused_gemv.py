"""The fused decode GEMV (interpret mode) against its reference twins, at shapes that are not
multiples of the block, with and without the layer index, bias, RMSNorm prologue and epilogues.

Tolerances: float32 1e-5 relative (the prologue reassociates the norm: (x*scale).w * rsqrt(ms));
bfloat16 2e-2 relative (the reference rounds the normed x to bf16 before the product, the kernel
does not; outputs are bf16, ~4e-3 per element).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxinfer.ops import LayerWeight, reference
from jaxinfer.pallas.fused_gemv import fused_gemv

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SHAPES = [(100, 72, 32), (256, 200, 64), (96, 130, 128)]  # (out, in, block_in)


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("kind", ["plain", "norm", "norm_bias", "residual", "swiglu"])
def test_fused_gemv_matches_reference(kind, shape, dtype, rows):
    """rows: output rows per program (the SwiGLU kernel's rows are gate rows: out / 2 of them)."""
    n_out, n_in, block_in = SHAPES[shape]
    if rows > 1 and dtype == jnp.bfloat16 and kind in ("plain", "norm"):
        pytest.skip("rows > 1: float32 and the epilogues cover it (interpret mode is slow on the CPU)")
    if (n_out // 2 if kind == "swiglu" else n_out) % rows:
        pytest.skip("rows must divide the output rows (tested below)")
    keys = jax.random.split(jax.random.PRNGKey(hash((kind, shape, str(dtype), rows)) % 2**31), 6)
    L, layer = 3, 1
    x = jax.random.normal(keys[0], (1, n_in), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (L, n_out, n_in), jnp.float32) / np.sqrt(n_in)).astype(dtype)
    scale = (1 + 0.2 * jax.random.normal(keys[2], (L, n_in), jnp.float32)).astype(dtype)
    b = jax.random.normal(keys[3], (L, n_out), jnp.float32).astype(dtype)
    res = jax.random.normal(keys[4], (1, n_out), jnp.float32).astype(dtype)
    lw, ls, lb = (LayerWeight(a, jnp.int32(layer)) for a in (w, scale, b))
    kw = dict(block_in=block_in, rows=rows, interpret=True)
    if kind == "plain":
        y, ref = fused_gemv(x, w, layer, **kw), reference.linear(x, lw)
    elif kind == "norm":
        y = fused_gemv(x, w, layer, scale=scale, eps=1e-6, **kw)
        ref = reference.rms_norm_linear(x, ls, 1e-6, lw)
    elif kind == "norm_bias":
        y = fused_gemv(x, w, layer, scale=scale, eps=1e-5, b=b, **kw)
        ref = reference.rms_norm_linear(x, ls, 1e-5, lw, lb)
    elif kind == "residual":
        y = fused_gemv(x, w, layer, b=b, residual=res, epilogue="residual", **kw)
        ref = reference.linear_residual(x, lw, lb, res)
    else:
        y = fused_gemv(x, w, layer, scale=scale, eps=1e-6, epilogue="swiglu", **kw)
        ref = reference.rms_norm_swiglu(x, ls, 1e-6, lw)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_float32_outputs_match_the_lm_head_reference(shape, dtype):
    """The lm_head at batch 1 (out_dtype float32): products of 16-bit values are exact in float32, so the
    kernel and reference.logits differ only in the order of float32 sums (1e-5 relative)."""
    n_out, n_in, block_in = SHAPES[shape]
    keys = jax.random.split(jax.random.PRNGKey(7 + shape), 2)
    x = jax.random.normal(keys[0], (1, n_in), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (n_out, n_in), jnp.float32) / np.sqrt(n_in)).astype(dtype)
    y = fused_gemv(x, w, block_in=block_in, out_dtype=jnp.float32, interpret=True)
    ref = reference.logits(x, w)
    assert y.shape == ref.shape and y.dtype == ref.dtype == jnp.float32
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("kind", ["norm_bias", "swiglu"])
def test_vectors_at_their_own_layer(kind):
    """model.split_layers: a one-layer matrix stack (layer 0) with its norm scale and bias in the stacked
    [L, ...] arrays at vector_layer 2."""
    n_out, n_in = 96, 130
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    x = jax.random.normal(keys[0], (1, n_in), jnp.float32)
    w = jax.random.normal(keys[1], (1, n_out, n_in), jnp.float32) / np.sqrt(n_in)
    scale = 1 + 0.2 * jax.random.normal(keys[2], (3, n_in), jnp.float32)
    b = jax.random.normal(keys[3], (3, n_out), jnp.float32)
    lw, ls, lb = LayerWeight(w, jnp.int32(0)), LayerWeight(scale, jnp.int32(2)), LayerWeight(b, jnp.int32(2))
    if kind == "norm_bias":
        y = fused_gemv(x, w, 0, scale=scale, b=b, eps=1e-6, vector_layer=2, block_in=32, interpret=True)
        ref = reference.rms_norm_linear(x, ls, 1e-6, lw, lb)
    else:
        y = fused_gemv(x, w, 0, scale=scale, eps=1e-6, epilogue="swiglu", vector_layer=2, block_in=32, interpret=True)
        ref = reference.rms_norm_swiglu(x, ls, 1e-6, lw)
    assert rel_err(y, ref) <= 1e-5


def test_one_layers_vectors_go_together():
    x, w = jnp.ones((1, 8), jnp.float32), jnp.ones((2, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match="both one layer's or both stacked"):
        fused_gemv(x, w, 1, scale=jnp.ones(8), b=jnp.ones((2, 4)), interpret=True)


@pytest.mark.parametrize("kind", ["norm_bias", "residual", "swiglu"])
def test_several_rows_per_program_give_the_one_row_outputs_bit_for_bit(kind):
    """Each row keeps its own [block_in] sums, as a one-row program's: greedy outputs cannot move with `rows`."""
    n_out, n_in = 64, 200
    keys = jax.random.split(jax.random.PRNGKey(11), 5)
    x = jax.random.normal(keys[0], (1, n_in), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (2, n_out, n_in), jnp.float32) / 8).astype(jnp.bfloat16)
    kw = dict(norm_bias=dict(scale=jax.random.normal(keys[2], (2, n_in)).astype(jnp.bfloat16),
                             b=jax.random.normal(keys[3], (2, n_out)).astype(jnp.bfloat16)),
              residual=dict(residual=jax.random.normal(keys[4], (1, n_out)).astype(jnp.bfloat16), epilogue="residual"),
              swiglu=dict(scale=jnp.ones((2, n_in), jnp.bfloat16), epilogue="swiglu"))[kind]
    one = fused_gemv(x, w, 1, block_in=64, interpret=True, **kw)
    for rows in (2, 4):
        np.testing.assert_array_equal(np.asarray(fused_gemv(x, w, 1, block_in=64, rows=rows, interpret=True, **kw)),
                                      np.asarray(one))


def test_rows_per_program_must_divide_the_output_rows():
    x, w = jnp.ones((1, 8), jnp.float32), jnp.ones((1, 12, 8), jnp.float32)
    for rows in (3, 8):
        with pytest.raises(ValueError, match="rows per program"):
            fused_gemv(x, w, 0, rows=rows, interpret=True)
    with pytest.raises(ValueError, match="rows per program"):   # SwiGLU: 6 gate rows
        fused_gemv(x, w, 0, epilogue="swiglu", rows=4, interpret=True)


def test_float32_outputs_only_without_an_epilogue():
    x, w = jnp.ones((1, 8), jnp.bfloat16), jnp.ones((2, 8, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        fused_gemv(x, w, 0, epilogue="swiglu", out_dtype=jnp.float32, interpret=True)


def test_the_layer_indices_are_one_entry_operands_never_a_joined_pair():
    """ops.pallas passes a kernel the matrix's layer and the vectors' (model.split_layers: they differ) as two
    one-entry operands: a joined [2] pair of constants becomes a kernel of its own on the GPU
    (blocks.layer_operands). The vectors are still read at their own layer."""
    from jaxinfer.ops import get_ops

    ops = get_ops("pallas-interpret")
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 32, 64)), jnp.float32)
    s = jnp.asarray(1 + 0.5 * rng.standard_normal((3, 64)), jnp.float32)

    def f(i, j):
        return ops.rms_norm_linear(x, LayerWeight(s, j), 1e-6, LayerWeight(w, i))

    text = str(jax.make_jaxpr(f)(jnp.int32(1), jnp.int32(2)))
    assert "concatenate" not in text and "stack" not in text
    got = f(jnp.int32(1), jnp.int32(2))
    np.testing.assert_allclose(got, reference.rms_norm_linear(x, s[2], 1e-6, w[1]), rtol=2e-5, atol=2e-5)
    assert not np.allclose(got, reference.rms_norm_linear(x, s[1], 1e-6, w[1]), rtol=1e-3)
