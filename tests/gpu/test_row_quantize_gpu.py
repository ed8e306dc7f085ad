"""W8A8's row quantization kernel (pallas/row_quantize.py) on the GPU at Qwen3-4B's widths and batched-decode /
prompt rows: without the norm, the same scales as XLA's quantize_rows and values a step apart at most; with it,
against quantize_rows(rms_norm(x)), values a step apart at most where the normed row rounded the other way (the mean
of squares summed in another order).

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_row_quantize_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.ops.quantized import MAX_VALUE, quantize_rows
from jaxinfer.pallas.row_quantize import row_quantize

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
FORMATS = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("M", [8, 64, 1024])
@pytest.mark.parametrize("N", [2560, 4096, 9728])
def test_matches_xlas_quantization(fmt, M, N):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(M + N), 3)
    x = (jax.random.normal(k1, (M, N)) * jnp.exp(jax.random.normal(k2, (M, 1)))).astype(jnp.bfloat16)
    q, s = jax.jit(lambda x: row_quantize(x, FORMATS[fmt], MAX_VALUE[fmt]))(x)
    want_q, want_s = jax.jit(lambda x: quantize_rows(x, FORMATS[fmt]))(x)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    # XLA's GPU fusion may round top / max otherwise than IEEE's division (H100, 2026-12-06: ~0.03% of int8 values
    # a step away): values a step apart at most, nearly all equal
    qf, wf = np.asarray(q.astype(jnp.float32)), np.asarray(want_q.astype(jnp.float32))
    step = 1.0 if fmt == "int8" else np.maximum(np.abs(wf) * 2 ** -3, 2 ** -9)
    assert np.all(np.abs(qf - wf) <= step + 1e-6)
    assert np.mean(qf == wf) > 0.999
    g = (1 + 0.1 * jax.random.normal(k3, (36, N))).astype(jnp.bfloat16)
    q, s = jax.jit(lambda x, g: row_quantize(x, FORMATS[fmt], MAX_VALUE[fmt], g, 1e-6, 5))(x, g)
    want_q, want_s = jax.jit(lambda x, g: quantize_rows(reference.rms_norm(x, g[5], 1e-6), FORMATS[fmt]))(x, g)
    np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), rtol=2 ** -7)
    qf, wf = np.asarray(q.astype(jnp.float32)), np.asarray(want_q.astype(jnp.float32))
    step = 1.0 if fmt == "int8" else np.maximum(np.abs(wf) * 2 ** -3, 2 ** -9)   # an e4m3 step: 1/8 of the value
    assert np.all(np.abs(qf - wf) <= step + 1e-6)
    assert np.mean(qf == wf) > 0.98
