"""Decode attention with the norm, RoPE and cache write folded in (pallas/decode_attention_rope.py) on
the GPU at real shapes, against its reference twin (reference.decode_qkv_attention).

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_decode_attention_rope_gpu.py
Shapes: Qwen3-4B (32 / 8 heads, hd 128, q/k norms, RoPE) and Llama-3-8B (32 / 8, hd 128, RoPE);
page size 16; contexts 1, 100, 1024, 8192 (rows of one batch at different lengths, the page table
spanning 8,192 positions as the engine's does); batch 1, 8, 64; fresh random bf16 inputs; the
configuration the table picks. Tolerances: the output per sequence, relative Frobenius 2e-2 (as
tests/gpu/test_decode_attention_gpu.py); the caches' new rows 1e-2; every other row untouched.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

PS, SPAN, L = 16, 8192, 2
SHAPES = {"qwen3-4b": (32, 8, 128, True), "llama3-8b": (32, 8, 128, False)}


def _reference(qkv, cos_sin, qn, kn, k, v, layer, slots, pt, cl, H, K, scale):
    qn, kn = (None, None) if qn is None else (qn[layer], kn[layer])
    return reference.decode_qkv_attention(qkv, cos_sin, qn, kn, 1e-6, k, v, layer, slots, pt, cl, PS, scale, H, K)


ref_op = jax.jit(_reference, static_argnums=(10, 11, 12))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("B", [1, 8, 64])
def test_against_the_reference_twin(shape, B):
    H, K, hd, norm = SHAPES[shape]
    rng = np.random.default_rng(B * 7 + len(shape))
    lens = rng.choice([1, 100, 1024, SPAN], B)
    lens[0] = SPAN if B > 1 else 1024
    P = SPAN // PS
    n_pages = B * P + 1
    cache_shape = (L, K, n_pages * PS, hd)
    k = jax.random.normal(jax.random.PRNGKey(B), cache_shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(B + 1), cache_shape, jnp.bfloat16)
    qkv = jax.random.normal(jax.random.PRNGKey(B + 2), (B, (H + 2 * K) * hd), jnp.bfloat16)
    pages = rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32)
    pos = lens - 1
    slots = jnp.asarray(pages[np.arange(B), pos // PS] * PS + pos % PS, jnp.int32)
    inv_freq = 1.0 / (1e6 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    cos_sin = reference.rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_freq), jnp.bfloat16)
    qn = kn = None
    if norm:
        qn = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(B + 3), (L, hd), jnp.bfloat16)
        kn = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(B + 4), (L, hd), jnp.bfloat16)
    layer, scale = jnp.int32(1), hd ** -0.5
    pt, cl = jnp.asarray(pages), jnp.asarray(lens.astype(np.int32))
    ro, rk, rv = ref_op(qkv, cos_sin, qn, kn, k, v, layer, slots, pt, cl, H, K, scale)
    o, ok, ov = decode_attention_rope_write(qkv, *cos_sin, qn, kn, jnp.array(k), jnp.array(v), layer, slots, pt, cl,
                                            page_size=PS, scale=scale, num_heads=H, num_kv_heads=K, eps=1e-6)
    o, ro = np.asarray(o, np.float32), np.asarray(ro, np.float32)
    for b in range(B):
        err = np.linalg.norm(o[b] - ro[b]) / np.linalg.norm(ro[b])
        assert err < 2e-2, f"sequence {b} (context {lens[b]}): relative error {err:.2e}"
    written = np.zeros(cache_shape, bool)
    written[1, :, np.asarray(slots)] = True
    for a, want in ((ok, rk), (ov, rv)):
        a, want = np.asarray(a, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(a[written] - want[written]) <= 1e-2 * np.linalg.norm(want[written])
        np.testing.assert_array_equal(a[~written], want[~written])
