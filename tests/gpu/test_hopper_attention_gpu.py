"""On the GPU: the Mosaic GPU flash attention for a fresh prompt against its float32 reference at real head shapes,
beside cuDNN's flash attention (the op it would replace) on the same inputs, fresh random inputs.

Run on the H200: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_hopper_attention_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.pallas import hopper_attention
from jaxinfer.pallas.hopper_attention import FlashConfig

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")


@pytest.mark.parametrize("T, H, KVH, hd, dtype, config", [
    (1024, 32, 8, 128, jnp.bfloat16, FlashConfig()),       # Qwen3-4B / Llama-3-8B
    (1024, 32, 8, 128, jnp.bfloat16, FlashConfig(stages=1)),
    (1024, 32, 8, 128, jnp.bfloat16, FlashConfig(pingpong=False)),
    (1024, 32, 8, 128, jnp.bfloat16, FlashConfig(persistent=False)),
    (1024, 32, 8, 128, jnp.bfloat16, FlashConfig(stages=1, q_buffers=2)),
    (2048, 32, 8, 128, jnp.bfloat16, FlashConfig(stages=1, pingpong=False)),
    (8192, 32, 8, 128, jnp.bfloat16, FlashConfig()),
    (2048, 16, 8, 128, jnp.bfloat16, FlashConfig()),       # Qwen3-0.6B
    (512, 8, 8, 64, jnp.float16, FlashConfig()),           # no GQA, hd 64
    (128, 4, 1, 128, jnp.bfloat16, FlashConfig()),         # one tile
])
def test_matches_reference_as_closely_as_cudnn(T, H, KVH, hd, dtype, config):
    """Against the float32 reference, the kernel's error is within a small factor of cuDNN's on the same inputs
    (both round P and the output to 16 bits); a masking, indexing or ordering error would be ~100x it."""
    ks = jax.random.split(jax.random.PRNGKey(T + H + hd), 3)
    q, k, v = (jax.random.normal(kk, (T, n, hd), jnp.float32).astype(dtype) for kk, n in zip(ks, (H, KVH, KVH)))
    scale = hd ** -0.5
    ref = np.asarray(reference.fresh_prompt_attention(*(a.astype(jnp.float32) for a in (q, k, v)), scale))
    out = np.asarray(hopper_attention.fresh_prompt_flash(q, k, v, scale, config=config), np.float32)
    cudnn = np.asarray(reference.fresh_prompt_attention(q, k, v, scale, implementation="cudnn"), np.float32)
    err, err_cudnn = np.abs(out - ref), np.abs(cudnn - ref)
    assert np.all(np.isfinite(out))
    assert err.max() <= 2 * err_cudnn.max() + 1e-3, (err.max(), err_cudnn.max())
    assert err.mean() <= 1.5 * err_cudnn.mean() + 1e-4, (err.mean(), err_cudnn.mean())
