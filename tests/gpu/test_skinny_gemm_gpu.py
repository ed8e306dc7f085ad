"""The tensor-core GEMM on the GPU at real shapes (Qwen3-4B, Llama-3-8B), against the reference ops,
with the config the tables pick: batched decode rows (on and off the 16-row tile) and prompt rows
(above 64: tiled over M).

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_skinny_gemm_gpu.py
Tolerance: relative Frobenius error 1e-2 in bf16 (output rounding alone is ~4e-3 per element).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.pallas.skinny_gemm import choose_config, skinny_gemm

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

SHAPES = [(6144, 2560, "none"), (2560, 4096, "residual"), (19456, 2560, "swiglu"), (2560, 9728, "residual"),
          (28672, 4096, "swiglu"), (4096, 14336, "residual")]


def _rel(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(y))
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("M", [2, 8, 27, 64, 128, 1000])   # above 64: prompt rows, tiled over M
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}-{e}" for n, k, e in SHAPES])
def test_skinny_gemm_at_real_shapes(shape, M):
    N, K, ep = shape
    kx, kw, kr = jax.random.split(jax.random.PRNGKey(N + K + M), 3)
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    w = jax.random.normal(kw, (2, N, K), jnp.bfloat16) * jnp.bfloat16(1 / np.sqrt(K))
    res = jax.random.normal(kr, (M, N), jnp.bfloat16)
    cfg = choose_config(M, N, K, ep)
    if ep == "residual":
        y, ref = skinny_gemm(x, w, 1, residual=res, epilogue=ep, config=cfg), reference.linear_residual(x, w[1], None, res)
    elif ep == "swiglu":
        y, ref = skinny_gemm(x, w, 1, epilogue=ep, config=cfg), reference.swiglu(reference.linear(x, w[1]))
    else:
        y, ref = skinny_gemm(x, w, 1, config=cfg), reference.linear(x, w[1])
    assert y.shape == ref.shape
    assert _rel(y, ref) <= 1e-2, cfg
