"""W8A8's row quantization kernel (pallas/row_quantize.py) in interpret mode against ops.quantized.quantize_rows
(bit for bit: the same arithmetic), with the RMSNorm folded in against quantize_rows(reference.rms_norm(x)); its
argument checks; its lowering for an H200 (IEEE division and cvt.rni in the PTX it asks for); and ops.pallas with
tables.ROW_QUANTIZE_KERNEL on: the W8A8 products (skinny, Mosaic and grouped GEMMs) give the same bits as with XLA's
quantization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer.ops.pallas as ops_pallas
from jaxinfer.ops import LayerWeight, get_ops, reference
from jaxinfer.ops.quantized import MAX_VALUE, quantize, quantize_rows
from jaxinfer.pallas import tables
from jaxinfer.pallas.hopper_gemm import HopperConfig
from jaxinfer.pallas.row_quantize import row_quantize

bf16, f32 = jnp.bfloat16, jnp.float32
FORMATS = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def _rows(seed, M, N, dtype=bf16):
    """Rows of very different magnitudes, a row of zeros among them (its scale: 1e-30 / top, its values 0)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(k1, (M, N)) * jnp.exp(2 * jax.random.normal(k2, (M, 1)))
    return x.at[M // 2].set(0).astype(dtype)


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a.astype(f32)), np.asarray(b.astype(f32)))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("M, N, dtype", [(1, 64, bf16), (5, 96, bf16), (64, 2560, bf16), (3, 100, f32),
                                         (7, 300, jnp.float16)])
def test_rows_equal_quantize_rows(fmt, M, N, dtype):
    x = _rows(M * N, M, N, dtype)
    q, s = row_quantize(x, FORMATS[fmt], MAX_VALUE[fmt], interpret=True)
    want_q, want_s = quantize_rows(x, FORMATS[fmt])
    assert q.dtype == jnp.dtype(FORMATS[fmt]) and s.dtype == f32 and s.shape == (M,)
    _same(q, want_q)
    _same(s, want_s)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("M, N, dtype", [(5, 96, bf16), (64, 2560, bf16), (3, 100, f32)])
def test_normed_rows_equal_quantize_rows_of_rms_norm(fmt, M, N, dtype):
    """The norm folded in: a [L, N] stack read at a layer, and a bare [N] vector."""
    x = _rows(M + N, M, N, dtype)
    g = (1 + 0.2 * jax.random.normal(jax.random.PRNGKey(3), (3, N))).astype(dtype)
    for scale, layer, vector in ((g, 2, g[2]), (g[1], 0, g[1])):
        q, s = row_quantize(x, FORMATS[fmt], MAX_VALUE[fmt], scale, 1e-5, layer, interpret=True)
        want_q, want_s = quantize_rows(reference.rms_norm(x, vector, 1e-5), FORMATS[fmt])
        if dtype == f32:   # float32 rows are not rounded after the norm: the sum of squares' order shows
            _within_rounding(q, s, want_q, want_s)
        else:
            _same(q, want_q)
            _same(s, want_s)


def _within_rounding(q, s, want_q, want_s):
    """The kernel's sum of squares and XLA:CPU's mean add in different orders (XLA:CPU's by the machine's vector
    width), so a float32 row's scale may differ in its last bits and a value lying on a rounding boundary may go
    one step the other way; nothing more."""
    np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), rtol=4 * np.finfo(np.float32).eps, atol=0)
    a, b = np.asarray(q.astype(f32)), np.asarray(want_q.astype(f32))
    step = 1.0 if q.dtype == jnp.int8 else np.maximum(np.abs(a), np.abs(b)) / 8   # e4m3: 3 mantissa bits
    assert np.all(np.abs(a - b) <= step), np.abs(a - b).max()
    assert np.mean(a != b) <= 0.01, np.mean(a != b)


def test_bad_arguments_are_refused():
    x = jnp.ones((4, 32), bf16)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        row_quantize(x, jnp.bfloat16, 127.0, interpret=True)
    with pytest.raises(ValueError, match=r"x \[M, N\]"):
        row_quantize(x[0], jnp.int8, 127.0, interpret=True)
    with pytest.raises(ValueError, match="does not fit"):
        row_quantize(x, jnp.int8, 127.0, jnp.ones((2, 16), bf16), interpret=True)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_lowers_for_an_h200_with_ieee_division(fmt):
    """Triton divides float32 approximately (div.full); the kernel asks for div.rn (and int8's cvt.rni), so that its
    scales are quantize_rows' bits on the GPU too."""
    from bench.kernel_registers import triton_modules

    S = jax.ShapeDtypeStruct
    [(attrs, text)] = triton_modules(lambda x, g: row_quantize(x, FORMATS[fmt], MAX_VALUE[fmt], g, 1e-6, 3),
                                     (S((64, 9728), bf16), S((36, 9728), bf16)))
    assert attrs["name"] == "row_quantize_norm"
    assert "div.rn.f32" in text and ("cvt.rni.f32.f32" in text) == (fmt == "int8")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_ops_with_the_kernel_give_the_same_bits(monkeypatch, fmt):
    """tables.ROW_QUANTIZE_KERNEL on: a batched decode step's W8A8 rows (the skinny kernel; the norm folded into the
    quantization for rms_norm_linear and rms_norm_swiglu; a split-K output projection's finish + norm kernel
    quantizing the gate/up's rows), prompt rows in the Mosaic GEMM's W8A8, and a mixture of experts' grouped GEMM in
    W8A8 equal the same ops with XLA's quantization, bit for bit."""
    M, D, I = 128, 128, 128
    ks = jax.random.split(jax.random.PRNGKey(5), 6)
    x = jax.random.normal(ks[0], (M, D)).astype(bf16)
    scale = LayerWeight((1 + 0.1 * jax.random.normal(ks[1], (2, D))).astype(bf16), jnp.int32(1))
    w_gu, w_down, w_q = (LayerWeight(quantize(jax.random.normal(k, (1, *shape)) / np.sqrt(shape[1]), fmt), jnp.int32(0))
                         for k, shape in zip(ks[2:5], [(2 * I, D), (D, I), (D, D)]))
    cfg = tables.SkinnyConfig(block_n=32, block_k=32, w8a8=True)
    small = HopperConfig(64, 32, 64, 2, epi_n=16)
    monkeypatch.setattr(tables, "SKINNY_GEMM_8BIT", {(n, k, ep, 64): cfg for n, k, ep in
                                                     [(2 * I, D, "swiglu"), (D, I, "residual"), (D, D, "none")]})
    # split K for the output projection: linear_residual_norm_swiglu's finish + norm kernel, quantizing for the gate/up
    tables.SKINNY_GEMM_8BIT[(D, I, "residual", 64)] = tables.SkinnyConfig(block_n=32, block_k=32, split_k=2, w8a8=True)
    monkeypatch.setattr(tables, "HOPPER_GEMM_8BIT", {(n, k, ep, fmt): ((M, M, small),) for n, k, ep in
                                                     [(2 * I, D, "swiglu"), (D, I, "residual"), (D, D, "none")]})
    monkeypatch.setattr(tables, "GROUPED_W8A8_ROWS", 1)
    ops = get_ops("pallas-interpret")
    E = 4
    router = LayerWeight(jax.random.normal(ks[5], (1, E, D)).astype(bf16), jnp.int32(0))
    experts = [LayerWeight(quantize(jax.random.normal(k, (1, E, *shape)) / 8, fmt), jnp.int32(0))
               for k, shape in zip(jax.random.split(ks[5], 2), [(2 * I, D), (D, I)])]

    def run(on):
        monkeypatch.setattr(tables, "ROW_QUANTIZE_KERNEL", on)
        jax.clear_caches()
        outs = []
        for rows in (64, M):       # 64: the skinny kernel (batched decode); 128: the Mosaic GEMM (prompt rows)
            h = ops.rms_norm_swiglu(x[:rows], scale, 1e-6, w_gu)
            outs += [ops.rms_norm_linear(x[:rows], scale, 1e-6, w_q), h,
                     ops.linear_residual(h, w_down, None, x[:rows])]
        outs.append(ops.moe_mlp(x[:8], router, *experts, 2, True))
        outs += list(ops.linear_residual_norm_swiglu(x[:64], w_down, None, x[64:], scale, 1e-6, w_gu))
        return [np.asarray(o.astype(f32)) for o in outs]

    calls, finishes = [], []
    kernel, finish = ops_pallas.row_quantize, ops_pallas.residual_norm.split_k_residual_rms_norm
    monkeypatch.setattr(ops_pallas, "row_quantize", lambda *a, **k: calls.append(len(a)) or kernel(*a, **k))
    monkeypatch.setattr(ops_pallas.residual_norm, "split_k_residual_rms_norm",
                        lambda *a, **k: finishes.append(k.get("quantize_to")) or finish(*a, **k))
    for a, b in zip(run(False), run(True)):
        np.testing.assert_array_equal(a, b)
    # the kernel ran: with the norm (4 args: x, dtype, top, scale...) for the normed products, without for the rest;
    # the split-K finish quantized the gate/up's rows itself with it on only
    assert any(n > 3 for n in calls) and any(n == 3 for n in calls), calls
    assert finishes[0] is None and finishes[-1] is not None and len(finishes) == 2, finishes
