"""On the GPU: the Mosaic GPU prompt GEMM against the reference ops at Qwen3-4B's prefill shapes, with every
epilogue and each config of its table, fresh random inputs; its W8A8 form against XLA's W8A8 product and float64.

Run on the H200: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_hopper_gemm_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import twins
from jaxinfer.pallas import hopper_gemm, tables
from jaxinfer.pallas.hopper_gemm import HopperConfig

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")

CASES = [(M, N, K, ep, cfg) for (N, K, ep), rows in tables.HOPPER_GEMM.items() for M, _, cfg in rows]
CASES += [(1024, 2560, 9728, "residual", HopperConfig(128, 128, 64, 3)),      # down, o_proj: not in the table
          (2048, 2560, 4096, "residual", HopperConfig(64, 256, 64, 3)),
          (256, 2560, 9728, "residual", HopperConfig(64, 128, 64, 4)),
          (1024, 6144, 2560, "none", HopperConfig(64, 256, 64, 3))]


@pytest.mark.parametrize("M, N, K, epilogue, config", CASES)
def test_matches_reference(M, N, K, epilogue, config):
    cols = N // 2 if epilogue == "swiglu" else N
    ks = jax.random.split(jax.random.PRNGKey(M + N + K), 3)
    x = jax.random.normal(ks[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (N, K), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    r = jax.random.normal(ks[2], (M, cols), jnp.float32).astype(jnp.bfloat16)
    y = hopper_gemm.hopper_gemm(x, w, residual=r if epilogue == "residual" else None, epilogue=epilogue,
                                config=config)
    ref = twins.hopper_gemm(x, w, r if epilogue == "residual" else None, epilogue)
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    # float32 sums in another order than cuBLAS's: round(x @ w.T) may land a bf16 step away (0.13% of elements at
    # K = 9,728), and with a residual that step is the product's (-2.9375 against -2.96875), so the tolerance is
    # a step or two of the product. A race reads a wrong tile: values far off (a wgmma group left in flight gave
    # rel err 4.9e-3 from 0.2% of elements, ~0.1 each), outside it.
    np.testing.assert_allclose(y, ref, rtol=2 ** -6, atol=2 ** -6)
    assert np.mean(y == ref) > 0.99


# W8A8 (8-bit x and weights, scales in the epilogue) at the shapes part 16 of experiments/gpu_round_next.sh sweeps
W8A8_CASES = [(1024, 6144, 2560, "none", HopperConfig(64, 128, 128, 4)),
              (1024, 19456, 2560, "swiglu", HopperConfig(64, 64, 128, 4)),
              (1024, 2560, 9728, "residual", HopperConfig(64, 128, 128, 4)),
              (8192, 2560, 9728, "residual", HopperConfig(64, 256, 128, 2))]
W8A8_CASES += [(M, N, K, ep, cfg) for (N, K, ep, _), rows in tables.HOPPER_GEMM_8BIT.items() for M, _, cfg in rows]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("M, N, K, epilogue, config", W8A8_CASES)
def test_w8a8_matches_xla_and_float64(M, N, K, epilogue, config, fmt):
    """Against XLA's W8A8 product of the same quantized rows and weights (int8: the same bits, the sums exact in
    int32; fp8: a bf16 step or two at most, 95% of outputs equal, against XLA's product at HIGHEST precision: at the
    default, cuBLAS's fast accumulation left 68-79% of outputs equal, H100 2026-12-05), and the fp8 product against float64 sums of
    the same e4m3 values within bf16's rounding and float32 sums' (an e4m3 wgmma chain over all of K accumulates
    with fewer bits than float32: why the kernel adds each k step's products to float32 sums in registers)."""
    from jaxinfer.ops.quantized import quantize, quantize_rows

    cols = N // 2 if epilogue == "swiglu" else N
    ks = jax.random.split(jax.random.PRNGKey(M + N + K), 3)
    x = jax.random.normal(ks[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    q = quantize(jax.random.normal(ks[1], (N, K), jnp.float32) / np.sqrt(K), fmt)
    r = jax.random.normal(ks[2], (M, cols), jnp.float32).astype(jnp.bfloat16)
    xq, xs = quantize_rows(x, q.dtype)
    y = hopper_gemm.hopper_gemm(xq, q.values, residual=r if epilogue == "residual" else None, epilogue=epilogue,
                                x_scale=xs, w_scale=q.scale, out_dtype=jnp.bfloat16, config=config)
    ref = twins.hopper_gemm_w8a8(x, q, r if epilogue == "residual" else None, epilogue)
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    if fmt == "fp8" and epilogue == "none":     # the float32 sums themselves, on a sample of rows
        rows = np.arange(0, M, max(1, M // 32))
        v = np.asarray(q.values.astype(jnp.float32), np.float64)
        xv = np.asarray(xq[rows].astype(jnp.float32), np.float64)
        exact = (xv @ v.T) * np.asarray(xs[rows], np.float64)[:, None] * np.asarray(q.scale, np.float64)[None, :]
        magnitude = (np.abs(xv) @ np.abs(v).T) * np.asarray(xs[rows], np.float64)[:, None] * np.asarray(
            q.scale, np.float64)[None, :]
        # rounding to bf16 (2^-9 of the value) plus float32 sums (K x 2^-24 of the magnitude)
        np.testing.assert_array_less(np.abs(y[rows] - exact), 2 ** -8 * np.abs(exact) + K * 2 ** -24 * magnitude
                                     + 1e-6)
    # against the twin, after the float64 check: a rounding disagreement with XLA is then told apart from an error
    if fmt == "int8":
        np.testing.assert_array_equal(y, ref)
    else:   # float32 sums in another grouping (promoted every 128 values): a bf16 step on a few percent at most
        np.testing.assert_allclose(y, ref, rtol=2 ** -6, atol=2 ** -6)
        assert np.mean(y == ref) > 0.95, np.mean(y == ref)
