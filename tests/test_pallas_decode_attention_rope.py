"""Decode attention with the new token's norm, RoPE and cache write folded in
(jaxinfer/pallas/decode_attention_rope.py), in interpret mode on the CPU, against its reference twin:
reference.qkv_rope_write then reference.paged_decode_attention.

Fresh random projections, caches and page tables per case (pages in random order); context lengths
of 1 (only the new token), ending mid-page, spanning several splits, and splits left empty; with and
without Qwen3's per-head norm and RoPE; several sequences, one of them padding on the scratch page.
Checked: the attention output (tolerances of tests/test_pallas_decode_attention.py); the caches'
new rows within the tolerances of tests/test_pallas_rope_kv_write.py (the norm sums its halves in
another order than the reference's mean: 1-ulp differences in float32), every other row untouched.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write, supports

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
KV_TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}   # relative Frobenius, the new rows


def _reference(qkv, cos_sin, qn, kn, k, v, layer, slots, pt, cl, H, K, ps, scale, eps):
    qn, kn = (None, None) if qn is None else (qn[layer], kn[layer])
    q, k, v = reference.qkv_rope_write(qkv, cos_sin, qn, kn, eps, k, v, layer, slots, H, K)
    return reference.paged_decode_attention(q, k, v, layer, pt, cl, ps, scale), k, v


def _problem(seed, B, H, K, hd, ps, lens, dtype, norm, rope, L=2):
    rng = np.random.default_rng(seed)
    P = -(-max(lens) // ps) + 1
    n_pages = B * P + 2
    shape = (L, K, n_pages * ps, hd)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    qkv = jnp.asarray(rng.standard_normal((B, (H + 2 * K) * hd), np.float32), dtype)
    pages = rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32)
    lens = np.asarray(lens, np.int32)
    pos = lens - 1
    slots = pages[np.arange(B), pos // ps] * ps + pos % ps
    cos_sin = None
    if rope:
        inv_freq = 1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
        cos_sin = reference.rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_freq), dtype)
    qn = kn = None
    if norm:
        qn = jnp.asarray(1 + 0.1 * rng.standard_normal((L, hd), np.float32), dtype)
        kn = jnp.asarray(1 + 0.1 * rng.standard_normal((L, hd), np.float32), dtype)
    return qkv, cos_sin, qn, kn, k, v, jnp.asarray(slots), jnp.asarray(pages), jnp.asarray(lens)


# (B, H, K, hd, page_size, context lens (counting the new token), num_splits, block_k, norm, rope)
CASES = [
    (1, 8, 4, 64, 16, [1], 1, 16, True, True),               # only the new token
    (1, 4, 4, 128, 16, [78], 4, 16, True, True),             # 77 cached, ends mid-page, 4 splits
    (3, 16, 2, 32, 8, [38, 1, 101], 4, 32, False, True),     # group 8, page 8, a length-1 row
    (3, 8, 4, 128, 16, [251, 17, 34], 8, 16, True, False),   # no RoPE (learned positions)
    (1, 16, 2, 64, 16, [301], 16, 16, True, True),           # some splits empty
    (2, 8, 2, 64, 16, [130, 65], 1, 32, False, False),       # one split: kernel 1 writes the output
]
IDS = [f"B{c[0]}-H{c[1]}-K{c[2]}-hd{c[3]}-ps{c[4]}-S{c[6]}-bk{c[7]}-{'norm' if c[8] else 'nonorm'}-"
       f"{'rope' if c[9] else 'norope'}" for c in CASES]


def _run(case, dtype, seed_offset=0):
    B, H, K, hd, ps, lens, S, bk, norm, rope = case
    qkv, cos_sin, qn, kn, k, v, slots, pt, cl = _problem(zlib.crc32(repr(case).encode()) + seed_offset, B, H, K, hd,
                                                         ps, lens, dtype, norm, rope)
    layer, scale, eps = jnp.int32(1), hd ** -0.5, 1e-6
    ref = jax.jit(_reference, static_argnums=(10, 11, 12, 13, 14))(qkv, cos_sin, qn, kn, k, v, layer, slots, pt, cl,
                                                                   H, K, ps, scale, eps)
    cos, sin = cos_sin if rope else (None, None)
    out = decode_attention_rope_write(qkv, cos, sin, qn, kn, jnp.array(k), jnp.array(v), layer, slots, pt, cl,
                                      page_size=ps, scale=scale, num_heads=H, num_kv_heads=K, eps=eps,
                                      config=DA.SplitConfig(num_splits=S, block_k=bk), interpret=True)
    written = np.zeros(k.shape, bool)
    written[1, :, np.asarray(slots)] = True
    return out, ref, written


def _check(out, ref, written, dtype):
    (o, k, v), (ro, rk, rv) = out, ref
    assert o.shape == ro.shape and o.dtype == ro.dtype
    for a, b in ((k, rk), (v, rv)):
        a, b = np.asarray(a.astype(jnp.float32), np.float64), np.asarray(b.astype(jnp.float32), np.float64)
        assert np.linalg.norm(a[written] - b[written]) <= KV_TOL[dtype] * np.linalg.norm(b[written])
        np.testing.assert_array_equal(a[~written], b[~written])
    o, ro = np.asarray(o.astype(jnp.float32)), np.asarray(ro.astype(jnp.float32))
    assert np.all(np.isfinite(o))
    err = np.max(np.abs(o - ro))
    assert err < TOL[dtype], f"max abs error {err:.3e}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32(case):
    _check(*_run(case, jnp.float32), jnp.float32)


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4]], ids=[IDS[1], IDS[2], IDS[4]])
def test_bfloat16(case):
    _check(*_run(case, jnp.bfloat16, seed_offset=1), jnp.bfloat16)


def test_supported_head_dims():
    assert supports(128) and supports(64) and supports(32)
    assert not supports(16) and not supports(96) and not supports(80)
    with pytest.raises(ValueError, match="decode_attention_rope_write"):
        decode_attention_rope_write(jnp.zeros((1, 3 * 16)), None, None, None, None, jnp.zeros((1, 1, 32, 16)),
                                    jnp.zeros((1, 1, 32, 16)), 0, jnp.zeros(1, jnp.int32), jnp.ones((1, 2), jnp.int32),
                                    jnp.ones(1, jnp.int32), page_size=16, scale=0.25, num_heads=1, num_kv_heads=1,
                                    interpret=True)
