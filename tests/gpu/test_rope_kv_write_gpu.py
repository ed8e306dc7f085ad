"""On the GPU: the norm/RoPE/KV-write kernel against ops.reference.qkv_rope_write at real shapes,
token counts around its 8-token tiles, a head dim whose halves are no power of two, and norms read from a one-layer
stack (per-layer weights).

Run on the H200: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_rope_kv_write_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import LayerWeight, reference
from jaxinfer.pallas.rope_kv_write import qkv_rope_write

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")

# H, K, head_dim; hd 96: halves of 48, padded to 64 masked columns in the kernel's tiles
SHAPES = {"qwen3-4b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "hd-96": (32, 8, 96)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("T", [1, 7, 8195])
@pytest.mark.parametrize("model", ["qwen3-4b", "hd-96"])
@pytest.mark.parametrize("one_layer_norms, with_kv", [(False, False), (True, True)])
def test_matches_reference(model, T, dtype, one_layer_norms, with_kv):
    H, K, hd = SHAPES[model]
    L, layer, slots = 4, 3, 16 * 1024
    ks = jax.random.split(jax.random.PRNGKey(T + H), 8)
    qkv = jax.random.normal(ks[0], (T, (H + 2 * K) * hd), jnp.float32).astype(dtype)
    kc = jax.random.normal(ks[1], (L, K, slots, hd), jnp.float32).astype(dtype)
    vc = jax.random.normal(ks[2], (L, K, slots, hd), jnp.float32).astype(dtype)
    qn = (1 + 0.2 * jax.random.normal(ks[3], (L, hd))).astype(dtype)
    kn = (1 + 0.2 * jax.random.normal(ks[4], (L, hd))).astype(dtype)
    norm_layer = layer
    if one_layer_norms:
        qn, kn, norm_layer = qn[layer][None], kn[layer][None], 0
    positions = jax.random.randint(ks[5], (T,), 0, 40000)
    inv_freq = 1.0 / (1e6 ** (jnp.arange(0, hd, 2) / hd))
    cos, sin = reference.rope_cos_sin(positions, inv_freq, dtype)
    slot_mapping = jax.random.permutation(ks[6], slots)[:T].astype(jnp.int32)
    lw = lambda a: LayerWeight(a, jnp.int32(norm_layer))   # noqa: E731
    ref = reference.qkv_rope_write(qkv, (cos, sin), lw(qn), lw(kn), 1e-6, kc, vc, jnp.int32(layer), slot_mapping, H, K,
                                   with_kv=with_kv)
    ours = qkv_rope_write(qkv, cos, sin, qn, kn, kc + 0, vc + 0, layer, slot_mapping, num_heads=H, num_kv_heads=K,
                          eps=1e-6, norm_layer=norm_layer, with_kv=with_kv)
    assert len(ours) == len(ref) == 3 + 2 * with_kv
    tol = 1e-5 if dtype == jnp.float32 else 1e-2

    def close(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b)

    close(ours[0], ref[0])
    for a, b in zip(ours[3:], ref[3:]):   # with_kv: the k and v written, as computed
        close(a, b)
    rows = np.asarray(slot_mapping)
    for a, b in zip(ours[1:3], ref[1:3]):   # the written rows, then every other row untouched
        close(a[layer][:, rows].astype(jnp.float32), b[layer][:, rows].astype(jnp.float32))
        assert bool(jnp.all(a[: layer] == b[: layer]))
