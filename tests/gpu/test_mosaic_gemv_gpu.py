"""The Mosaic GPU decode GEMV (pallas/mosaic_gemv.py) on the GPU at Qwen3-4B's products, against its twin (float32
products rounded to bf16: relative error < 1e-2; the sums' order differs), with and without griddepcontrol (the same
outputs bit for bit: the same products, only the wait moves). Runs only where JAX sees a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas.mosaic_gemv import mosaic_gemv, reference, supported

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.parametrize("T", [1, 8, 16])
@pytest.mark.parametrize("N, K, epilogue", [(6144, 2560, "none"), (19456, 2560, "swiglu"), (2560, 4096, "residual"),
                                             (2560, 9728, "residual")])
def test_matches_its_twin_at_real_shapes(T, N, K, epilogue):
    if not supported(T, N, K, epilogue):
        pytest.skip("16 rows of x do not fit in shared memory beside the ring at K = 9,728")
    kx, kw = jax.random.split(jax.random.PRNGKey(N + K + T))
    x = jax.random.normal(kx, (T, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (1, N, K), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    res = jax.random.normal(kx, (T, N), jnp.float32).astype(jnp.bfloat16) if epilogue == "residual" else None
    y = mosaic_gemv(x, w, 0, residual=res, epilogue=epilogue)
    ref = reference(x, w, 0, epilogue, res)
    err = float(jnp.linalg.norm((y - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    assert err < 1e-2, err
    np.testing.assert_array_equal(np.asarray(mosaic_gemv(x, w, 0, residual=res, epilogue=epilogue, pdl=True)),
                                  np.asarray(y))
