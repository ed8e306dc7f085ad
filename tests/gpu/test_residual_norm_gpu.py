"""The split-K finish fused with the RMSNorm after it, on the GPU at the shapes the engine gives it (the
attention's output projection of Qwen3-4B and Llama-3-8B at batch 2-64), against its XLA twin; and the
op that uses it against the reference ops.

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_residual_norm_gpu.py
Tolerance: bf16 1e-2 relative (output rounding alone is ~4e-3 per element), float32 1e-6.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import LayerWeight, get_ops, reference, twins
from jaxinfer.pallas import residual_norm

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _rel(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(y))
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("S,M,N", [(4, 8, 2560), (4, 64, 2560), (8, 3, 4096), (2, 33, 2560)])
def test_kernel_matches_its_twin(S, M, N, dtype):
    keys = jax.random.split(jax.random.PRNGKey(S * M + N), 3)
    partials = jax.random.normal(keys[0], (S, M, N), jnp.float32)
    residual = (3 * jax.random.normal(keys[1], (M, N), jnp.float32)).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(keys[2], (36, N), jnp.float32)).astype(dtype)
    r, h = residual_norm.split_k_residual_rms_norm(partials, residual, scale, 1e-6, 5)
    r_ref, h_ref = jax.jit(twins.split_k_residual_rms_norm, static_argnums=(3, 4))(partials, residual, scale, 1e-6, 5)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
    assert _rel(r, r_ref) <= tol and _rel(h, h_ref) <= tol


@pytest.mark.parametrize("M", [8, 32, 64])
def test_op_at_qwen3_4b_shapes(M):
    """Qwen3-4B's o_proj (2,560 x 4,096, split-K in the table) then its gate/up + SwiGLU, bf16."""
    D, Q, I, L = 2560, 4096, 9728, 4
    keys = jax.random.split(jax.random.PRNGKey(M), 5)
    bf = jnp.bfloat16
    attn = jax.random.normal(keys[0], (M, Q), jnp.float32).astype(bf)
    x = jax.random.normal(keys[1], (M, D), jnp.float32).astype(bf)
    wo = (jax.random.normal(keys[2], (L, D, Q), jnp.float32) / np.sqrt(Q)).astype(bf)
    wgu = (jax.random.normal(keys[3], (L, 2 * I, D), jnp.float32) / np.sqrt(D)).astype(bf)
    scale = (1 + 0.1 * jax.random.normal(keys[4], (L, D), jnp.float32)).astype(bf)
    lw, lgu, ls = (LayerWeight(a, jnp.int32(3)) for a in (wo, wgu, scale))
    ops = get_ops("pallas")
    fn = jax.jit(lambda a, r: ops.linear_residual_norm_swiglu(a, lw, None, r, ls, 1e-6, lgu))
    assert "split_k_residual_rms_norm" in str(jax.make_jaxpr(fn)(attn, x))
    r, h = fn(attn, x)
    r_ref, h_ref = jax.jit(lambda a, r: reference.linear_residual_norm_swiglu(a, lw, None, r, ls, 1e-6, lgu))(attn, x)
    assert _rel(r, r_ref) <= 1e-2 and _rel(h, h_ref) <= 2e-2
