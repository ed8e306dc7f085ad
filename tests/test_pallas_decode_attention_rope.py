"""Decode attention with the new token's norm, RoPE and cache write folded in
(jaxinfer/pallas/decode_attention_rope.py), in interpret mode on the CPU, against its reference twin:
reference.qkv_rope_write then reference.paged_decode_attention.

Fresh random projections, caches and page tables per case (pages in random order); context lengths
of 1 (only the new token), ending mid-page, spanning several splits, and splits left empty; with and
without Qwen3's per-head norm and RoPE; several sequences, one of them padding on the scratch page.
Checked: the attention output (tolerances of tests/test_pallas_decode_attention.py); the caches'
new rows within the tolerances of tests/test_pallas_rope_kv_write.py (the norm sums its halves in
another order than the reference's mean: 1-ulp differences in float32), every other row untouched.
With an INT8 cache: the new rows' values within one step of the reference's quantization (a 1-ulp k may round the
other way), their scales within that rounding, the in-kernel quantizer bit for bit against quantize.
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


def _int8_run(case, dtype, convert, seed_offset=5):
    """_run with an INT8 cache (vectors of magnitudes spread over 1e-3..10, quantized) against the reference twin
    reading and writing it through ops.quantized_cache."""
    from jaxinfer.ops.quantized_cache import QuantizedCache, quantize

    B, H, K, hd, ps, lens, S, bk, norm, rope = case
    qkv, cos_sin, qn, kn, k, v, slots, pt, cl = _problem(zlib.crc32(repr(case).encode()) + seed_offset, B, H, K, hd,
                                                         ps, lens, dtype, norm, rope)
    rng = np.random.default_rng(seed_offset)
    amp = lambda: jnp.asarray(10.0 ** rng.uniform(-3, 1, k.shape[:-1] + (1,)), jnp.float32)
    kq, vq = QuantizedCache(*quantize(k.astype(jnp.float32) * amp())), QuantizedCache(*quantize(v * amp()))
    layer, scale, eps = jnp.int32(1), hd ** -0.5, 1e-6
    ref = jax.jit(_reference, static_argnums=(10, 11, 12, 13, 14))(qkv, cos_sin, qn, kn, kq, vq, layer, slots, pt, cl,
                                                                   H, K, ps, scale, eps)
    cos, sin = cos_sin if rope else (None, None)
    out = decode_attention_rope_write(qkv, cos, sin, qn, kn, jnp.array(kq.values), jnp.array(vq.values), layer, slots,
                                      pt, cl, page_size=ps, scale=scale, num_heads=H, num_kv_heads=K, eps=eps,
                                      k_scale=jnp.array(kq.scale), v_scale=jnp.array(vq.scale), int8_convert=convert,
                                      config=DA.SplitConfig(num_splits=S, block_k=bk), interpret=True)
    written = np.zeros(k.shape[:-1], bool)
    written[1, :, np.asarray(slots)] = True
    return out, ref, written


def _int8_check(out, ref, written, dtype):
    """New rows: scales within the new k's rounding (1-ulp differences of the norm), values within one step;
    every other row and scale untouched; the output within the tolerances above, relative to values up to ~10."""
    o, k, v, ks, vs = out
    ro, rk, rv = ref
    for values, scales, want in ((k, ks, rk), (v, vs, rv)):
        assert values.dtype == jnp.int8 and scales.dtype == jnp.float32
        a, b = np.asarray(values, np.int32), np.asarray(want.values, np.int32)
        np.testing.assert_array_equal(a[~written], b[~written])
        np.testing.assert_array_equal(np.asarray(scales)[~written], np.asarray(want.scale)[~written])
        assert np.abs(a[written] - b[written]).max() <= 1
        np.testing.assert_allclose(np.asarray(scales)[written], np.asarray(want.scale)[written],
                                   rtol=1e-6 if dtype == jnp.float32 else 1e-2)
    assert o.shape == ro.shape and o.dtype == ro.dtype
    o, ro = np.asarray(o.astype(jnp.float32)), np.asarray(ro.astype(jnp.float32))
    assert np.all(np.isfinite(o))
    err = np.max(np.abs(o - ro)) / 10
    assert err < TOL[dtype], f"max abs error {err:.3e} (over 10)"


@pytest.mark.parametrize("case, convert", [(CASES[0], "cvt"), (CASES[1], "bits"), (CASES[2], "cvt"), (CASES[4], "bits"),
                                           (CASES[5], "cvt")],
                         ids=[IDS[0] + "-cvt", IDS[1] + "-bits", IDS[2] + "-cvt", IDS[4] + "-bits", IDS[5] + "-cvt"])
def test_int8_cache_float32(case, convert):
    _int8_check(*_int8_run(case, jnp.float32, convert), jnp.float32)


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[IDS[1], IDS[3]])
def test_int8_cache_bfloat16(case):
    _int8_check(*_int8_run(case, jnp.bfloat16, "bits"), jnp.bfloat16)


def test_int8_new_vector_quantized_exactly_as_the_cache_quantizes():
    """The in-kernel quantizer against ops.quantized_cache.quantize, bit for bit: ties of .5 (half to even), a zero
    vector, the clip at 127, random vectors."""
    from jaxinfer.ops.quantized_cache import quantize
    from jaxinfer.pallas.rope_kv_write import quantize_vectors

    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(64).astype(np.float32) * 10.0 ** rng.uniform(-4, 4) for _ in range(20)]
    rows.append(np.zeros(64, np.float32))
    rows.append(np.array([127.0, 2.5, -2.5, 3.5, 0.5, -0.5, 1.5, 126.5] * 8, np.float32))   # scale 1: exact ties
    rows.append(np.array([0.49999997, -0.49999997, 1.4999999, -2.5000002, 126.49999, 127.0, 0.0, 5.5] * 8,
                         np.float32))                                             # next to ties
    jitted = jax.jit(quantize_vectors)     # as in the kernel's interpret mode (XLA folds some roundings under jit)
    for x in rows:
        values, scale = quantize(jnp.asarray(x))
        for f in (quantize_vectors, jitted):
            got_scale, (a, b) = f([jnp.asarray(x[:32]), jnp.asarray(x[32:])])
            assert float(got_scale) == float(scale)
            np.testing.assert_array_equal(np.concatenate([np.asarray(a), np.asarray(b)]), np.asarray(values))
    rows = np.stack(rows)                   # several vectors at once: a scale each
    values, scale = quantize(jnp.asarray(rows))
    got_scale, (a, b) = jitted([jnp.asarray(rows[:, :32]), jnp.asarray(rows[:, 32:])])
    np.testing.assert_array_equal(np.asarray(got_scale), np.asarray(scale))
    np.testing.assert_array_equal(np.concatenate([np.asarray(a), np.asarray(b)], axis=1), np.asarray(values))
