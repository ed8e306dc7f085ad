"""The fused GEMV's lm_head on the GPU at real vocabularies, against reference.logits.

Runs only where JAX sees a GPU:
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_fused_gemv_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.parametrize("vocab,hidden", [(151936, 2560), (128256, 4096), (151936, 1024)])
def test_lm_head_float32_logits(vocab, hidden):
    """ops.pallas's lm_head at batch 1: the fused GEMV with float32 outputs at real vocabularies, against
    reference.logits (float32, HIGHEST): only the order of float32 sums differs."""
    from jaxinfer.ops import reference
    from jaxinfer.pallas.fused_gemv import block_in_for, fused_gemv

    kx, kw = jax.random.split(jax.random.PRNGKey(vocab + hidden))
    x = jax.random.normal(kx, (1, hidden), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (vocab, hidden), jnp.float32) / np.sqrt(hidden)).astype(jnp.bfloat16)
    y = fused_gemv(x, w, block_in=block_in_for(vocab, hidden, w.dtype), out_dtype=jnp.float32)
    ref = reference.logits(x, w)
    assert y.dtype == jnp.float32 and y.shape == ref.shape
    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert err < 1e-5, f"relative error {err:.3e}"
    assert int(jnp.argmax(y)) == int(jnp.argmax(ref))
