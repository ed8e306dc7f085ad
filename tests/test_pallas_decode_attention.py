"""Split-sequence paged decode attention (jaxinfer/pallas/decode_attention.py) in interpret mode on the CPU,
against reference.paged_decode_attention.

Fresh random q, K, V and page tables per case (pages in random order, never contiguous); context
lengths that end mid-page, length 1, lengths spanning several splits, and splits left empty.
Tolerance (max abs error; outputs are O(0.1-1)): float32 2e-5; bfloat16 2e-2 (the kernel rounds the
unnormalised probabilities to bf16 before the p @ v product where the reference rounds the normalised
ones, and both round the output: a few bf16 ulps).

The INT8 cache (values and scales as operands) against the reference op on the same QuantizedCache, whose rows it
dequantizes: vectors of magnitudes 1e-3..10 (so the tolerances apply to outputs divided by 10), both int8
conversions, poisoned scales in unseen slots, and the one clear error for bad operands.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import poisoned_outside
from jaxinfer.ops import reference
from jaxinfer.pallas import decode_attention as DA

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
# One compile per case instead of one per op (op-by-op dispatch costs ~0.8 s a call on the CPU).
ref_op = jax.jit(reference.paged_decode_attention, static_argnums=(6, 7))


def _problem(seed, B, H, KVH, hd, page_size, lens, dtype, extra_pages=0, L=2):
    rng = np.random.default_rng(seed)
    P = -(-max(lens) // page_size) + extra_pages
    n_pages = B * P + 1 + rng.integers(0, 4)          # page 0 is scratch, never in a table here
    shape = (L, KVH, n_pages * page_size, hd)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    q = jnp.asarray(rng.standard_normal((B, H, hd), np.float32), dtype)
    pages = rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32)
    return q, k, v, jnp.asarray(pages), jnp.asarray(np.asarray(lens, np.int32))


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.all(np.isfinite(out))
    err = np.max(np.abs(out - ref))
    assert err < TOL[dtype], f"max abs error {err:.3e}"


# (B, H, KVH, hd, page_size, context lens, num_splits, block_k)
CASES = [
    (1, 8, 4, 64, 16, [1], 1, 16),                 # length 1
    (1, 4, 4, 128, 16, [77], 4, 16),                # ends mid-page, 5 blocks over 4 splits
    (3, 16, 2, 8, 8, [37, 1, 100], 4, 32),          # hd 8 (masked columns), page 8, group 8
    (3, 8, 4, 128, 16, [250, 16, 33], 8, 16),       # many splits, one length exactly a page
    (3, 4, 4, 64, 8, [64, 129, 5], 2, 64),          # block of 64 over 8-slot pages
    (1, 16, 2, 64, 16, [300], 16, 16),              # 19 blocks over 16 splits: some splits empty
    (3, 8, 4, 8, 16, [5, 1, 20], 8, 16),            # more splits than blocks
    (3, 16, 2, 128, 16, [130, 64, 1], 1, 32),       # one split: kernel 1 writes the output
]
IDS = [f"B{c[0]}-H{c[1]}-KV{c[2]}-hd{c[3]}-ps{c[4]}-S{c[6]}-bk{c[7]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32(case):
    B, H, KVH, hd, ps, lens, S, bk = case
    q, k, v, pt, cl = _problem(zlib.crc32(repr(case).encode()), B, H, KVH, hd, ps, lens, jnp.float32)
    layer = jnp.int32(1)
    ref = ref_op(q, k, v, layer, pt, cl, ps, hd ** -0.5)
    out = DA.paged_decode_attention(q, k, v, layer, pt, cl, ps, hd ** -0.5,
                                    config=DA.SplitConfig(num_splits=S, block_k=bk), interpret=True)
    _check(out, ref, jnp.float32)


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[2]], ids=[IDS[1], IDS[3], IDS[2]])
@pytest.mark.parametrize("merge", ["pallas", "jnp"])
def test_bfloat16(case, merge):
    B, H, KVH, hd, ps, lens, S, bk = case
    q, k, v, pt, cl = _problem(zlib.crc32(repr(case).encode()) + 1, B, H, KVH, hd, ps, lens, jnp.bfloat16)
    layer = jnp.int32(0)
    ref = ref_op(q, k, v, layer, pt, cl, ps, hd ** -0.5)
    out = DA.paged_decode_attention(q, k, v, layer, pt, cl, ps, hd ** -0.5,
                                    config=DA.SplitConfig(num_splits=S, block_k=bk, merge=merge),
                                    interpret=True)
    _check(out, ref, jnp.bfloat16)


def test_table_choice_under_jit_wide_page_table():
    """The default config, layer traced, a page table much wider than the contexts (as the engine pads it)."""
    B, H, KVH, hd, ps = 3, 8, 4, 64, 16
    lens = [200, 3, 45]
    q, k, v, pt, cl = _problem(11, B, H, KVH, hd, ps, lens, jnp.float32, extra_pages=20)
    cfg = DA.choose_config(B, KVH, pt.shape[1] * ps)
    assert cfg.num_splits > 1
    f = jax.jit(lambda *a: DA.paged_decode_attention(*a, ps, hd ** -0.5, interpret=True))
    out = f(q, k, v, jnp.int32(1), pt, cl)
    ref = ref_op(q, k, v, jnp.int32(1), pt, cl, ps, hd ** -0.5)
    _check(out, ref, jnp.float32)


def test_padding_rows_and_poisoned_slots_give_no_nan():
    """Padding rows (context 1 on scratch page 0) and NaN/inf in every slot no row may see: no NaN, and the
    visible slots give the reference's answer."""
    B, H, KVH, hd, ps = 3, 8, 4, 16, 8
    lens = [1, 13, 1]
    q, k, v, pt, cl = _problem(5, B, H, KVH, hd, ps, lens, jnp.float32)
    pt = pt.at[0].set(0).at[2].set(0)                    # padding rows point at the scratch page
    k_bad, v_bad = poisoned_outside(k, v, pt, ps, lens)
    ref = ref_op(q, k, v, jnp.int32(0), pt, cl, ps, 0.25)
    for S in (1, 4):
        out = DA.paged_decode_attention(q, k_bad, v_bad, jnp.int32(0), pt, cl, ps, 0.25,
                                        config=DA.SplitConfig(num_splits=S, block_k=16), interpret=True)
        _check(out, ref, jnp.float32)


def test_zero_context_gives_zeros():
    q, k, v, pt, _ = _problem(3, 2, 4, 2, 16, 16, [16, 16], jnp.float32)
    out = DA.paged_decode_attention(q, k, v, jnp.int32(0), pt, jnp.asarray([0, 5], jnp.int32), 16, 0.25,
                                    config=DA.SplitConfig(num_splits=2, block_k=16), interpret=True)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isfinite(np.asarray(out)))


def test_choose_config_shapes():
    for B in (1, 2, 8, 32, 64, 256):
        for span in (16, 1024, 8192, 32768):
            for kvh in (2, 8, 16):
                for itemsize in (2, 1):   # bf16 and float8 pages
                    c = DA.choose_config(B, kvh, span, itemsize)
                    assert DA.is_pow2(c.num_splits) and 1 <= c.num_splits <= 64
                    assert DA.is_pow2(c.block_k) and c.block_k >= 16
                    assert c.num_splits * c.block_k < 2 * span or c.num_splits == 1
    assert DA.choose_config(1, 8, 32768).num_splits >= 16     # batch 1, long context: many splits
    assert DA.choose_config(64, 8, 1024).num_splits <= 2


def test_rejects_bad_configs():
    q, k, v, pt, cl = _problem(0, 1, 4, 2, 16, 16, [5], jnp.float32)
    with pytest.raises(ValueError):
        DA.paged_decode_attention(q, k, v, 0, pt, cl, 16, 0.25, config=DA.SplitConfig(num_splits=3),
                                  interpret=True)
    with pytest.raises(ValueError):
        DA.paged_decode_attention(q, k, v, 0, pt, cl, 16, 0.25, config=DA.SplitConfig(block_k=8),
                                  interpret=True)
    with pytest.raises(ValueError):
        DA.paged_decode_attention(q[:, :3], k, v, 0, pt, cl, 16, 0.25, interpret=True)


@pytest.mark.parametrize("cached_offset", [0, 1], ids=["plain", "rope"])
def test_merge_reads_only_the_splits_that_had_positions(cached_offset):
    """The merge kernel skips the splits its sequence's context left empty (split 0 always read). Empty splits'
    memory is poisoned with NaN: read, it would spoil the output; skipped, the output equals the merge of clean
    partials (empty splits as kernel 1 writes them: o = 0, lse = NEG) bit for bit."""
    rng = np.random.default_rng(7)
    B, H, S, hd, bk, max_ctx = 4, 4, 16, 64, 16, 16 * 16 * 4
    ctx = np.array([1, 17, 100, max_ctx], np.int32)    # counting the RoPE kernel's new token where cached_offset = 1
    n_blocks = -(-(ctx - cached_offset) // bk)
    per = -(-n_blocks // S)
    live = (np.arange(S)[None, :] * per[:, None] < n_blocks[:, None]) | (np.arange(S)[None, :] == 0)
    assert (~live).any() and live.any(axis=1).all()
    o = rng.standard_normal((B, H, S, hd)).astype(np.float32)
    lse = (3 * rng.standard_normal((B, H, S))).astype(np.float32)
    clean_o = np.where(live[:, None, :, None], o, 0.0)
    clean_lse = np.where(live[:, None, :], lse, DA.NEG)
    poisoned_o = np.where(live[:, None, :, None], o, np.nan)
    poisoned_lse = np.where(live[:, None, :], lse, np.nan)

    def merge(o_part, lse_part, lens):
        return DA.merge_splits(jnp.asarray(o_part), jnp.asarray(lse_part), jnp.float32, hd, interpret=True,
                               context_lens=jnp.asarray(lens), block_k=bk, max_ctx=max_ctx,
                               cached_offset=cached_offset)

    everything = np.full((B,), max_ctx, np.int32)   # every split counted as live: the merge reads all S
    want = np.asarray(merge(clean_o, clean_lse, everything))
    got = np.asarray(merge(poisoned_o, poisoned_lse, ctx))
    np.testing.assert_array_equal(got, want)
    assert np.isnan(np.asarray(merge(poisoned_o, poisoned_lse, everything))).any()


def _int8_problem(seed, B, H, KVH, hd, page_size, lens, dtype, poison_scales=False):
    """_problem's case with an INT8 cache: vectors of random magnitudes (spread over 1e-3..10) quantized."""
    from jaxinfer.ops.quantized_cache import QuantizedCache, quantize

    q, k, v, pt, cl = _problem(seed, B, H, KVH, hd, page_size, lens, jnp.float32)
    rng = np.random.default_rng(seed + 7)
    amp = lambda: jnp.asarray(10.0 ** rng.uniform(-3, 1, k.shape[:-1] + (1,)), jnp.float32)
    kq, vq = QuantizedCache(*quantize(k * amp())), QuantizedCache(*quantize(v * amp()))
    return q.astype(dtype), kq, vq, pt, cl


# (B, H, KVH, hd, page_size, context lens, num_splits, block_k)
INT8_CASES = [CASES[0], CASES[1], CASES[2], CASES[5], CASES[7]]
INT8_IDS = [IDS[0], IDS[1], IDS[2], IDS[5], IDS[7]]


@pytest.mark.parametrize("case, convert", [(c, ["cvt", "bits"][i % 2]) for i, c in enumerate(INT8_CASES)],
                         ids=[f"{x}-{['cvt', 'bits'][i % 2]}" for i, x in enumerate(INT8_IDS)])
def test_int8_cache_float32(case, convert):
    """An INT8 cache's values and scales as operands: the reference op reading the dequantized rows."""
    B, H, KVH, hd, ps, lens, S, bk = case
    q, kq, vq, pt, cl = _int8_problem(zlib.crc32(repr(case).encode()) + 2, B, H, KVH, hd, ps, lens, jnp.float32)
    layer = jnp.int32(1)
    ref = ref_op(q, kq, vq, layer, pt, cl, ps, hd ** -0.5)
    out = DA.paged_decode_attention(q, kq.values, vq.values, layer, pt, cl, ps, hd ** -0.5, k_scale=kq.scale,
                                    v_scale=vq.scale, config=DA.SplitConfig(num_splits=S, block_k=bk),
                                    int8_convert=convert, interpret=True)
    _check(out / 10, ref / 10, jnp.float32)    # values up to ~10: the tolerance relative to that


@pytest.mark.parametrize("convert", ["cvt", "bits"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[IDS[1], IDS[3]])
def test_int8_cache_bfloat16(case, convert):
    """bf16 queries: float16 products of the exact int8 values (page_compute_dtype)."""
    B, H, KVH, hd, ps, lens, S, bk = case
    q, kq, vq, pt, cl = _int8_problem(zlib.crc32(repr(case).encode()) + 3, B, H, KVH, hd, ps, lens, jnp.bfloat16)
    ref = ref_op(q, kq, vq, jnp.int32(0), pt, cl, ps, hd ** -0.5)
    out = DA.paged_decode_attention(q, kq.values, vq.values, jnp.int32(0), pt, cl, ps, hd ** -0.5,
                                    k_scale=kq.scale, v_scale=vq.scale, int8_convert=convert,
                                    config=DA.SplitConfig(num_splits=S, block_k=bk), interpret=True)
    _check(out / 10, ref / 10, jnp.bfloat16)


def test_int8_to_is_exact():
    x = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        for how in ("cvt", "bits"):
            got = DA.int8_to(x, dtype, how)
            assert got.dtype == dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32)[1:], np.arange(-127, 128, dtype=np.float32))
    with pytest.raises(ValueError, match="int8 conversion"):
        DA.int8_to(x, jnp.float16, "lut")


def test_int8_cache_bad_operands_get_one_clear_error():
    q, kq, vq, pt, cl = _int8_problem(4, 1, 4, 2, 16, 16, [5], jnp.float32)
    call = lambda k, v, ks, vs, **kw: DA.paged_decode_attention(q, k, v, 0, pt, cl, 16, 0.25, k_scale=ks, v_scale=vs,
                                                                interpret=True, **kw)
    with pytest.raises(ValueError, match="needs int8 k and v values and both scales"):
        call(kq.values, vq.values, kq.scale, None)
    with pytest.raises(ValueError, match="needs int8 k and v values and both scales"):
        call(kq.values, vq.values, None, None)
    with pytest.raises(ValueError, match="want"):
        call(kq.values, vq.values, kq.scale[:, :1], vq.scale)
    with pytest.raises(ValueError, match="int8_convert"):
        call(kq.values, vq.values, kq.scale, vq.scale, int8_convert="lut")


def test_int8_cache_poisoned_scales_of_unseen_slots_give_no_nan():
    """Padding rows (context 1 on scratch page 0) and NaN/inf scales in every slot no row may see: no NaN, and the
    visible slots give the reference's answer (the masked scale loads never reach the scores or probabilities)."""
    from jaxinfer.ops.quantized_cache import QuantizedCache

    B, H, KVH, hd, ps = 3, 8, 4, 16, 8
    lens = [1, 13, 1]
    q, kq, vq, pt, cl = _int8_problem(6, B, H, KVH, hd, ps, lens, jnp.float32)
    pt = pt.at[0].set(0).at[2].set(0)
    slots = np.asarray(pt)[:, :, None] * ps + np.arange(ps)
    visible = np.zeros(kq.scale.shape[2], bool)
    for b, n in enumerate(lens):
        visible[slots[b].reshape(-1)[:n]] = True
    poison = jnp.asarray(np.where(np.arange(visible.size) % 2 == 0, np.nan, np.inf).astype(np.float32))
    bad = lambda c: QuantizedCache(c.values, jnp.where(jnp.asarray(visible), c.scale, poison))
    ref = ref_op(q, kq, vq, jnp.int32(0), pt, cl, ps, 0.25)
    for S in (1, 4):
        k_bad, v_bad = bad(kq), bad(vq)
        out = DA.paged_decode_attention(q, k_bad.values, v_bad.values, jnp.int32(0), pt, cl, ps, 0.25,
                                        k_scale=k_bad.scale, v_scale=v_bad.scale,
                                        config=DA.SplitConfig(num_splits=S, block_k=16), interpret=True)
        _check(out / 10, ref / 10, jnp.float32)
