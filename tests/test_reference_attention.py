"""The reference paged attention's two layouts agree with each other and with dense causal attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference


def _dense(q, k, v, scale):
    """Plain causal attention of one sequence: q [T, H, hd], k/v [T, KVH, hd]."""
    T, H, hd = q.shape
    g = H // k.shape[1]
    k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
    s = jnp.einsum("thd,shd->hts", q, k, precision="highest") * scale
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None], s, -jnp.inf)
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(s, -1), v, precision="highest")


@pytest.mark.parametrize("B, H, kvh, hd", [(1, 8, 4, 8), (3, 4, 2, 16), (40, 4, 4, 8)])
def test_ragged_batch_equals_dense_per_sequence(B, H, kvh, hd):
    ps, L, layer = 4, 2, 1
    rng = np.random.default_rng(B * 100 + H)
    lens = rng.integers(1, 13, B)
    P = int(-(-lens.max() // ps))
    pages = rng.permutation(np.arange(1, B * P + 1)).reshape(B, P).astype(np.int32)   # non-contiguous
    slots_n = (B * P + 1) * ps
    k_cache = np.zeros((L, kvh, slots_n, hd), np.float32)
    v_cache = np.zeros_like(k_cache)
    qs, token_seq, positions, want = [], [], [], []
    for b, n in enumerate(lens):
        q = rng.standard_normal((n, H, hd)).astype(np.float32)
        k = rng.standard_normal((n, kvh, hd)).astype(np.float32)
        v = rng.standard_normal((n, kvh, hd)).astype(np.float32)
        pos = np.arange(n)
        slot = pages[b, pos // ps] * ps + pos % ps
        k_cache[layer][:, slot] = k.transpose(1, 0, 2)
        v_cache[layer][:, slot] = v.transpose(1, 0, 2)
        qs.append(q), token_seq.append(np.full(n, b)), positions.append(pos)
        want.append(np.asarray(_dense(q, k, v, hd ** -0.5)))
    args = (jnp.asarray(np.concatenate(qs)), jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.int32(layer),
            jnp.asarray(pages), jnp.asarray(np.concatenate(token_seq), jnp.int32),
            jnp.asarray(np.concatenate(positions), jnp.int32), ps, hd ** -0.5)
    want = np.concatenate(want)
    for chunk in (None, 16, 5):
        got = np.asarray(reference.paged_attention(*args, chunk=chunk))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("n, T, H, kvh, hd, dtype", [(7, 16, 8, 4, 8, "float32"), (33, 48, 4, 2, 16, "float32"),
                                                     (64, 64, 8, 2, 32, "bfloat16")])
def test_fresh_prompt_attention_equals_the_paged_op(n, T, H, kvh, hd, dtype):
    """One prompt of n tokens from position 0, padded to T rows (padding: slot of the scratch page,
    position 0, as the engine pads): the fresh-prompt op (on the K/V of the slots just written, gathered
    back; jax.nn.dot_product_attention) equals the paged op on the prompt's rows."""
    ps, L, layer = 4, 2, 1
    rng = np.random.default_rng(n * 7 + T)
    P = -(-n // ps)
    pages = rng.permutation(np.arange(1, P + 3))[:P].astype(np.int32)   # non-contiguous, page 0 = scratch
    k_cache = rng.standard_normal((L, kvh, (P + 3) * ps, hd)).astype(np.float32)   # stale data around
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    pos = np.arange(n)
    slots = np.concatenate([pages[pos // ps] * ps + pos % ps, np.arange(T - n) % ps]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((T, H, hd)), dtype)
    k_cache, v_cache = jnp.asarray(k_cache, dtype), jnp.asarray(v_cache, dtype)
    k, v = reference.gather_kv(k_cache, v_cache, jnp.int32(layer), jnp.asarray(slots), q.dtype)
    got = reference.fresh_prompt_attention(q, k, v, hd ** -0.5)
    positions = np.concatenate([pos, np.zeros(T - n, int)]).astype(np.int32)
    want = reference.paged_attention(q, k_cache, v_cache, jnp.int32(layer), jnp.asarray(pages[None]),
                                     jnp.zeros(T, jnp.int32), jnp.asarray(positions), ps, hd ** -0.5)
    tol = 2e-2 if dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(np.asarray(got[:n], np.float32), np.asarray(want[:n], np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("prefix, n, T, H, kvh, hd, dtype", [(5, 7, 16, 8, 4, 8, "float32"),
                                                            (32, 17, 24, 4, 2, 16, "float32"),
                                                            (13, 30, 32, 8, 2, 32, "bfloat16"), (1, 1, 8, 4, 4, 8, "float32")])
def test_prefixed_chunk_attention_equals_the_paged_op(prefix, n, T, H, kvh, hd, dtype):
    """One sequence's chunk of n tokens after `prefix` cached ones (ending mid-page or not), padded to T
    rows as the engine pads: the prefix part (gathered over the whole page row) and the chunk part merged
    by their log-sum-exps equal the paged op on the chunk's rows."""
    ps, L, layer, pages_per_seq = 4, 2, 1, 16
    rng = np.random.default_rng(prefix * 31 + n)
    P = -(-(prefix + n) // ps)
    pages = rng.permutation(np.arange(1, P + 5))[:P].astype(np.int32)   # non-contiguous, page 0 = scratch
    page_row = np.zeros(pages_per_seq, np.int32)
    page_row[:P] = pages
    k_cache = rng.standard_normal((L, kvh, (P + 5) * ps, hd)).astype(np.float32)
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    pos = np.arange(prefix, prefix + n)
    slots = np.concatenate([pages[pos // ps] * ps + pos % ps, np.arange(T - n) % ps]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((T, H, hd)), dtype)
    k_cache, v_cache = jnp.asarray(k_cache, dtype), jnp.asarray(v_cache, dtype)
    got = reference.prefixed_chunk_attention(q, k_cache, v_cache, jnp.int32(layer), jnp.asarray(page_row),
                                             jnp.int32(prefix), jnp.asarray(slots), ps, hd ** -0.5)
    positions = np.concatenate([pos, np.zeros(T - n, int)]).astype(np.int32)
    want = reference.paged_attention(q, k_cache, v_cache, jnp.int32(layer), jnp.asarray(page_row[None]),
                                     jnp.zeros(T, jnp.int32), jnp.asarray(positions), ps, hd ** -0.5)
    tol = 2e-2 if dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(np.asarray(got[:n], np.float32), np.asarray(want[:n], np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_rows", [8, 16])
def test_prefixed_chunk_attention_by_row_blocks_equals_all_rows(monkeypatch, block_rows):
    """Above LSE_BLOCK_ROWS query rows the XLA attention runs a block of rows at a time (its float32 scores
    bounded; a 32k prompt's chunks took 32 GB a layer at once): the same outputs as all rows at once, with
    the causal chunk part's mask offset per block and a last block that is partly padding (T = 24 at 16)."""
    rng = np.random.default_rng(block_rows)
    T, H, kvh, hd, ps, prefix = 24, 4, 2, 8, 4, 10
    k_cache = jnp.asarray(rng.standard_normal((1, kvh, 64 * ps, hd)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal(k_cache.shape), jnp.float32)
    page_row = jnp.asarray(rng.permutation(np.arange(1, 64))[:16], jnp.int32)
    pos = np.arange(prefix, prefix + T)
    slots = jnp.asarray(np.asarray(page_row)[pos // ps] * ps + pos % ps, jnp.int32)
    q = jnp.asarray(rng.standard_normal((T, H, hd)), jnp.float32)
    args = (q, k_cache, v_cache, jnp.int32(0), page_row, jnp.int32(prefix), slots, ps, hd ** -0.5)
    whole = reference.prefixed_chunk_attention(*args)
    monkeypatch.setattr(reference, "LSE_BLOCK_ROWS", block_rows)
    blocked = reference.prefixed_chunk_attention(*args)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-6, atol=1e-6)
