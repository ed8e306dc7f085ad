"""The one-sequence attentions on the GPU at real shapes, against the paged reference op: a fresh prompt
(cuDNN's flash attention through jax.nn.dot_product_attention, on the K/V of the slots just written, gathered
back here as the engine does for a float8 cache) and a chunk after a cached prefix (two cuDNN attentions merged by their log-sum-exps).

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_fresh_prompt_attention_gpu.py
Qwen3-4B / Llama-3-8B attention (32 / 8 heads, hd 128), bf16 and a float8 cache, page size 16, pages in
random order, prompts of 128, 1,000 (padded to 1,024 as the engine pads) and 2,048 tokens. Tolerance:
relative Frobenius error 2e-2 on the prompt's rows (bf16 products; tests/gpu/test_prefill_attention_gpu.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.numerics import to_cache
from jaxinfer.ops import get_ops, reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

PS, L, H, KVH, HD = 16, 2, 32, 8, 128


def _paged_caches(rng, P, kv_dtype):
    """P pages in random order among P + 8 (page 0 is the scratch page), and random caches around them."""
    n_pages = P + 8
    pages = rng.permutation(np.arange(1, n_pages))[:P].astype(np.int32)
    k_cache = jnp.asarray(rng.standard_normal((L, KVH, n_pages * PS, HD)), jnp.bfloat16)
    v_cache = jnp.asarray(rng.standard_normal((L, KVH, n_pages * PS, HD)), jnp.bfloat16)
    if kv_dtype != "bfloat16":
        k_cache, v_cache = to_cache(k_cache, jnp.dtype(kv_dtype)), to_cache(v_cache, jnp.dtype(kv_dtype))
    return pages, k_cache, v_cache


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("n, T", [(128, 128), (1000, 1024), (2048, 2048)])
def test_fresh_prompt_attention_on_cudnn_equals_the_paged_reference(n, T, kv_dtype):
    rng = np.random.default_rng(n + T)
    P = -(-n // PS)
    pages, k_cache, v_cache = _paged_caches(rng, P, kv_dtype)
    pos = np.arange(n)
    slots = np.concatenate([pages[pos // PS] * PS + pos % PS, np.arange(T - n) % PS]).astype(np.int32)
    positions = np.concatenate([pos, np.zeros(T - n, int)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((T, H, HD)), jnp.bfloat16)
    layer, scale = jnp.int32(1), HD ** -0.5
    ops = get_ops("pallas")
    k, v = ops.gather_kv(k_cache, v_cache, layer, jnp.asarray(slots), q.dtype)   # what the cache holds
    got = jax.jit(ops.fresh_prompt_attention, static_argnums=3)(q, k, v, scale)
    want = reference.paged_attention(q, k_cache, v_cache, layer, jnp.asarray(pages[None]), jnp.zeros(T, jnp.int32),
                                     jnp.asarray(positions), PS, scale)
    got, want = np.asarray(got[:n], np.float32), np.asarray(want[:n], np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("prefix, n, T", [(1000, 1000, 1024), (6144, 2048, 2048), (30000, 2000, 2048)])
def test_prefixed_chunk_attention_on_cudnn_equals_the_paged_reference(prefix, n, T, kv_dtype):
    """A chunk of n tokens after `prefix` cached ones (ending mid-page or not), padded to T rows, its page
    row padded with the scratch page to 40,960 tokens as in the server: two cuDNN attentions merged by the
    log-sum-exps cuDNN returns (the convention the merge assumes) against the paged reference."""
    rng = np.random.default_rng(prefix + n)
    P = -(-(prefix + n) // PS)
    pages, k_cache, v_cache = _paged_caches(rng, P, kv_dtype)
    row = np.zeros(40960 // PS, np.int32)
    row[:P] = pages
    pos = np.arange(prefix, prefix + n)
    slots = np.concatenate([pages[pos // PS] * PS + pos % PS, np.arange(T - n) % PS]).astype(np.int32)
    positions = np.concatenate([pos, np.zeros(T - n, int)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((T, H, HD)), jnp.bfloat16)
    layer, scale = jnp.int32(1), HD ** -0.5
    got = jax.jit(get_ops("pallas").prefixed_chunk_attention, static_argnums=(7, 8))(
        q, k_cache, v_cache, layer, jnp.asarray(row), jnp.int32(prefix), jnp.asarray(slots), PS, scale)
    want = reference.paged_attention(q, k_cache, v_cache, layer, jnp.asarray(row[None]), jnp.zeros(T, jnp.int32),
                                     jnp.asarray(positions), PS, scale)
    got, want = np.asarray(got[:n], np.float32), np.asarray(want[:n], np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
