"""On the GPU: the Mosaic GPU prompt GEMM against the reference ops at Qwen3-4B's prefill shapes, with every
epilogue and each config of its table, fresh random inputs.

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
