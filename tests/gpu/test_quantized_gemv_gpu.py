"""The 8-bit weight kernels on the GPU at Qwen3-4B's shapes, against their twin (twins.linear_8bit): the batch-1 GEMV
(each projection with its prologue and epilogue, both int8 conversions, the lm_head's float32 logits), the
batched-decode GEMM at 16 and 64 rows, and ops.pallas's dispatch.

Runs only where JAX sees a GPU:
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_quantized_gemv_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

f32, bf16 = jnp.float32, jnp.bfloat16
# Qwen3-4B: (out, in, epilogue, norm prologue)
PROJECTIONS = {"qkv": (6144, 2560, "none", True), "o_proj": (2560, 4096, "residual", False),
               "gate_up": (19456, 2560, "swiglu", True), "down": (2560, 9728, "residual", False)}
FORMATS = {"int8": (jnp.int8, None), "fp8": (jnp.float8_e4m3fn, None), "fp8-block": (jnp.float8_e4m3fn, (128, 128))}


def weight(n, k, fmt, seed=0):
    from jaxinfer.ops.quantized import QuantizedWeight

    dtype, block = FORMATS[fmt]
    kv, ks = jax.random.split(jax.random.PRNGKey(seed))
    if dtype == jnp.int8:
        values, top = jax.random.randint(kv, (n, k), -127, 128).astype(jnp.int8), 127.0
    else:
        values, top = jnp.clip(jax.random.normal(kv, (n, k)) * 150, -448, 448).astype(dtype), 448.0
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    return QuantizedWeight(values, jax.random.uniform(ks, shape, f32, 0.5, 1.5) / (top * np.sqrt(k)), block)


def err(y, ref) -> float:
    y, ref = np.asarray(y.astype(f32), np.float64), np.asarray(ref.astype(f32), np.float64)
    assert np.all(np.isfinite(y))
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def inputs(n, k, M, seed=1):
    kx, ks, kr = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kx, (M, k), f32).astype(bf16),
            (1 + 0.1 * jax.random.normal(ks, (k,), f32)).astype(bf16), jax.random.normal(kr, (M, n), f32).astype(bf16))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("proj", list(PROJECTIONS))
def test_gemv_8bit_at_qwen3_4b_shapes(proj, fmt):
    from jaxinfer.ops import twins
    from jaxinfer.pallas.fused_gemv import block_in_for, fused_gemv, rows_for

    n, k, epilogue, norm = PROJECTIONS[proj]
    w = weight(n, k, fmt)
    x, scale, res = inputs(n, k, 1)
    rows_n = n // 2 if epilogue == "swiglu" else n
    kw = dict(epilogue=epilogue, scale=scale if norm else None)
    if epilogue == "residual":
        kw["residual"] = res
    ref = twins.linear_8bit(x, w, **kw)
    converts = ("bits", "cvt", "prmt") if fmt == "int8" else (None,)
    for convert in converts:
        y = fused_gemv(x, w.values, w_scale=w.scale, w_block=w.block, int8_convert=convert,
                       block_in=block_in_for(rows_n, k, w.dtype, w.block), rows=rows_for(rows_n, k, w.dtype), **kw)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert err(y, ref) < 2e-2, convert


@pytest.mark.parametrize("rows,warps", [(1, 1), (4, 1), (8, 2)])
def test_int8_conversions_give_the_same_bits(rows, warps):
    """Every int8 conversion yields the exact float (all 256 values appear in w), so the GEMV's outputs agree bit for
    bit whichever converts."""
    from jaxinfer.pallas.fused_gemv import INT8_CONVERTS, fused_gemv

    n, k = 512, 2560
    values = (jnp.arange(n * k, dtype=jnp.int32) % 256 - 128).astype(jnp.int8).reshape(n, k)
    w_scale = jnp.full((n,), 1 / 4096, f32)
    x, scale, _ = inputs(n, k, 1)
    outs = {c: np.asarray(fused_gemv(x, values, scale=scale, w_scale=w_scale, int8_convert=c, rows=rows,
                                     num_warps=warps, block_in=512)) for c in INT8_CONVERTS}
    for c in INT8_CONVERTS:
        np.testing.assert_array_equal(outs[c], outs["cvt"], err_msg=c)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_gemv_8bit_lm_head_logits(fmt):
    """Qwen3-4B's [151936, 2560] lm_head in 8 bits: float32 logits, the twin's argmax."""
    from jaxinfer.ops import get_ops, twins

    w = weight(151936, 2560, fmt, seed=3)
    x, _, _ = inputs(1, 2560, 1, seed=4)
    y = get_ops("pallas").logits(x, w)
    ref = twins.linear_8bit(x, w, out_dtype=f32)
    assert y.dtype == f32 and err(y, ref) < 1e-5
    assert int(jnp.argmax(y)) == int(jnp.argmax(ref))


@pytest.mark.parametrize("M", [16, 64])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("proj", list(PROJECTIONS))
def test_skinny_gemm_8bit_at_qwen3_4b_shapes(proj, fmt, M):
    from jaxinfer.ops import twins
    from jaxinfer.pallas import skinny_gemm as SG

    n, k, epilogue, _ = PROJECTIONS[proj]
    w = weight(n, k, fmt)
    x, _, res = inputs(n, k, M)
    kw = dict(residual=res) if epilogue == "residual" else {}
    y = SG.skinny_gemm(x, w.values, w_scale=w.scale, w_block=w.block, epilogue=epilogue,
                       config=SG.choose_config(M, n, k, epilogue), **kw)
    ref = twins.linear_8bit(x, w, epilogue=epilogue, **kw)
    assert y.shape == ref.shape and err(y, ref) < 2e-2


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("M", [16, 64])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("proj", list(PROJECTIONS))
def test_skinny_gemm_w8a8_at_qwen3_4b_shapes(proj, fmt, M, split_k):
    """W8A8 in the batched-decode kernel (x's rows quantized, 8-bit tile products: int8 on IGMMA, e4m3 on QGMMA
    through pallas/fp8_dot.py) against XLA's W8A8 product of the same rows (fp8 sums in float32, not cuBLAS's fast
    accumulation)."""
    from jaxinfer.ops.pallas import xla_w8a8_product
    from jaxinfer.ops.quantized import quantize_rows
    from jaxinfer.pallas import skinny_gemm as SG

    n, k, epilogue, _ = PROJECTIONS[proj]
    w = weight(n, k, fmt)
    x, _, res = inputs(n, k, M)
    kw = dict(residual=res) if epilogue == "residual" else {}
    xq, xs = quantize_rows(x, w.dtype)
    cfg = SG.SkinnyConfig(block_n=64, block_k=128, split_k=split_k, w8a8=True)
    y = SG.skinny_gemm(xq, w.values, w_scale=w.scale, x_scale=xs, out_dtype=bf16, epilogue=epilogue, config=cfg, **kw)
    p = xla_w8a8_product(x, w, precise=True).astype(bf16)
    ref = res + p if epilogue == "residual" else SG.silu_mul(*jnp.split(p, 2, axis=-1)) if epilogue == "swiglu" else p
    assert y.shape == ref.shape and err(y, ref) < 1e-2


@pytest.mark.parametrize("M", [1, 16, 256])
def test_ops_pallas_layer_with_int8_weights(M):
    """One Qwen3-4B MLP block through ops.pallas with int8 weights in split-layer form (one-layer stacks): the GEMV at
    1 row, the skinny kernel or XLA at 16, XLA's product at 256; against the twins."""
    from jaxinfer.ops import LayerWeight, get_ops, twins

    ops = get_ops("pallas")
    gu, down = weight(19456, 2560, "int8", 5), weight(2560, 9728, "int8", 6)
    x, scale, res = inputs(2560, 2560, M, seed=7)
    one = lambda w: LayerWeight(w[None], jnp.int32(0))
    h = ops.rms_norm_swiglu(x, scale, 1e-6, one(gu))
    y = ops.linear_residual(h, one(down), None, res)
    h_ref = twins.linear_8bit(x, gu, scale=scale, epilogue="swiglu")
    assert err(h, h_ref) < 2e-2
    assert err(y, twins.linear_8bit(h, down, residual=res, epilogue="residual")) < 2e-2
