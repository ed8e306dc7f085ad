"""Speculative verify attention (jaxinfer/pallas/verify_attention.py) in interpret mode on the CPU, against
reference.verify_attention; its Triton lowering at real shapes (an H200 described to the CPU).

Fresh random q, K, V and page tables per case (pages in random order, never contiguous); Q 2-16 rows a sequence,
groups of 1-8 query heads a KV head (7 too; tiles of 16-128 rows), head dims 48 (masked columns), 64 and 128; ragged
contexts: shorter than a page, ending mid-page, exactly a page, shorter than Q (rows clamped to position 0), rows
masked out of whole splits; padding sequences of context 0 on the scratch page. Tolerance (max abs error; outputs
are O(0.1-1)): float32 2e-5; bfloat16 and float8 pages 2e-2 (the kernel rounds the unnormalised probabilities to
bf16 (f16 over float8 pages) before p @ v where the reference rounds the normalised ones: a few ulps).
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.triton import gpu_info

from conftest import poisoned_outside
from jaxinfer.model.kv_cache import to_cache
from jaxinfer.ops import get_ops, reference
from jaxinfer.pallas import tables
from jaxinfer.pallas import verify_attention as VA

F8 = jnp.float8_e4m3fn
TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}
# One compile per case instead of one per op (op-by-op dispatch costs ~0.8 s a call on the CPU).
ref_op = jax.jit(reference.verify_attention, static_argnums=(6, 7))


def _problem(seed, B, Q, H, KVH, hd, page_size, lens, dtype, kv_dtype=None, extra_pages=0, L=2):
    rng = np.random.default_rng(seed)
    P = -(-max(max(lens), 1) // page_size) + extra_pages
    n_pages = B * P + 1 + rng.integers(0, 4)          # page 0 is scratch, never in a table here
    shape = (L, KVH, n_pages * page_size, hd)
    k = to_cache(jnp.asarray(rng.standard_normal(shape, np.float32), dtype), kv_dtype or dtype)
    v = to_cache(jnp.asarray(rng.standard_normal(shape, np.float32), dtype), kv_dtype or dtype)
    q = jnp.asarray(rng.standard_normal((B, Q, H, hd), np.float32), dtype)
    pages = rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32)
    return q, k, v, jnp.asarray(pages), jnp.asarray(np.asarray(lens, np.int32))


def _check(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = TOL[jnp.dtype(ref.dtype)]
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.all(np.isfinite(out))
    err = np.max(np.abs(out - ref))
    assert err < tol, f"max abs error {err:.3e}"


# (B, Q, H, KVH, hd, page_size, context lens, num_splits, block_k, dtype, kv dtype)
CASES = [
    (3, 2, 4, 4, 64, 16, [77, 5, 16], 4, 16, jnp.float32, None),     # group 1; mid-page, within a page, a page
    (2, 4, 8, 4, 128, 16, [130, 37], 2, 32, jnp.bfloat16, None),     # group 2, hd 128
    (3, 8, 8, 2, 64, 8, [100, 9, 3], 8, 16, jnp.float32, None),      # group 4, pages of 8; context 3 < Q
    (2, 16, 8, 2, 64, 16, [200, 17], 4, 32, jnp.bfloat16, None),     # group 4, Q 16: 64-row tiles
    (2, 16, 4, 2, 64, 16, [20, 33], 2, 16, jnp.float32, None),       # rows 0-11 of sequence 0 see no split-1 block
    (1, 16, 8, 1, 64, 16, [300], 16, 16, jnp.float32, None),         # group 8, Q 16: 128 rows; empty splits
    (2, 4, 16, 2, 48, 16, [50, 21], 1, 32, jnp.float32, None),       # group 8, hd 48 (masked columns), one split
    (2, 5, 14, 2, 64, 16, [45, 70], 4, 16, jnp.float32, None),       # group 7 (Qwen2.5-7B's): 35 rows in 64
    (3, 4, 8, 2, 128, 16, [90, 1, 40], 4, 16, jnp.bfloat16, F8),     # float8 pages (f16 products)
    (2, 8, 8, 4, 64, 16, [64, 150], 1, 64, jnp.bfloat16, F8),        # float8 pages, one split
]
IDS = [f"B{c[0]}-Q{c[1]}-H{c[2]}-KV{c[3]}-hd{c[4]}-ps{c[5]}-S{c[7]}-bk{c[8]}-{jnp.dtype(c[10] or c[9]).name}"
       for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_against_reference(case):
    B, Q, H, KVH, hd, ps, lens, S, bk, dtype, kv_dtype = case
    q, k, v, pt, cl = _problem(zlib.crc32(repr(case).encode()), B, Q, H, KVH, hd, ps, lens, dtype, kv_dtype)
    layer = jnp.int32(1)
    ref = ref_op(q, k, v, layer, pt, cl, ps, hd ** -0.5)
    out = VA.paged_verify_attention(q, k, v, layer, pt, cl, ps, hd ** -0.5, config=VA.SplitConfig(S, bk),
                                    interpret=True)
    _check(out, ref)


def test_jnp_merge():
    B, Q, H, KVH, hd, ps, lens = 2, 4, 8, 2, 64, 16, [90, 13]
    q, k, v, pt, cl = _problem(21, B, Q, H, KVH, hd, ps, lens, jnp.bfloat16)
    ref = ref_op(q, k, v, jnp.int32(0), pt, cl, ps, 0.125)
    out = VA.paged_verify_attention(q, k, v, jnp.int32(0), pt, cl, ps, 0.125,
                                    config=VA.SplitConfig(4, 16, merge="jnp"), interpret=True)
    _check(out, ref)


def test_op_set_under_jit_wide_page_table():
    """get_ops("pallas-interpret").verify_attention, the table's config, layer traced, a page table much wider than
    the contexts (as the engine pads it)."""
    B, Q, H, KVH, hd, ps = 3, 4, 8, 2, 64, 16
    lens = [200, 4, 45]
    q, k, v, pt, cl = _problem(11, B, Q, H, KVH, hd, ps, lens, jnp.float32, extra_pages=20)
    assert VA.choose_config(Q * H // KVH, B, KVH, pt.shape[1] * ps).num_splits > 1
    op = get_ops("pallas-interpret").verify_attention
    out = jax.jit(lambda *a: op(*a, ps, hd ** -0.5))(q, k, v, jnp.int32(1), pt, cl)
    _check(out, ref_op(q, k, v, jnp.int32(1), pt, cl, ps, hd ** -0.5))


def test_padding_sequences_and_poisoned_slots_give_no_nan():
    """Padding sequences (context 0 on scratch page 0) and NaN/inf in every slot no row may see: no NaN, and the
    visible slots give the reference's answer."""
    B, Q, H, KVH, hd, ps = 3, 4, 8, 2, 16, 8
    lens = [0, 13, 0]
    q, k, v, pt, cl = _problem(5, B, Q, H, KVH, hd, ps, [13] * B, jnp.float32)
    cl = jnp.asarray(lens, jnp.int32)
    pt = pt.at[0].set(0).at[2].set(0)                    # padding sequences point at the scratch page
    # context 0 still sees position 0 (the reference clamps)
    k_bad, v_bad = poisoned_outside(k, v, pt, ps, [max(n, 1) for n in lens])
    ref = ref_op(q, k, v, jnp.int32(0), pt, cl, ps, 0.25)
    for S in (1, 4):
        out = VA.paged_verify_attention(q, k_bad, v_bad, jnp.int32(0), pt, cl, ps, 0.25,
                                        config=VA.SplitConfig(S, 16), interpret=True)
        _check(out, ref)


def test_op_set_falls_back_where_the_kernel_does_not_serve():
    """Q x group > 128 rows, or a 128-row tile of head_dim 256: the op set gives the reference op's result."""
    assert VA.supports(128, 128) and VA.supports(64, 256) and VA.supports(2, 8)
    assert not VA.supports(129, 64) and not VA.supports(128, 256)
    op = get_ops("pallas-interpret").verify_attention
    for B, Q, H, KVH, hd in [(1, 16, 16, 1, 16), (1, 16, 8, 1, 256)]:
        q, k, v, pt, cl = _problem(B + Q + hd, B, Q, H, KVH, hd, 16, [40], jnp.float32)
        np.testing.assert_array_equal(np.asarray(op(q, k, v, jnp.int32(0), pt, cl, 16, 0.25)),
                                      np.asarray(reference.verify_attention(q, k, v, jnp.int32(0), pt, cl, 16, 0.25)))


def test_choose_config_shapes():
    for rows in (2, 16, 64, 128):
        for B in (1, 2, 8, 32, 64, 256):
            for span in (16, 1024, 8192, 32768):
                for kvh in (2, 8, 16):
                    c = VA.choose_config(rows, B, kvh, span)
                    assert VA.is_pow2(c.num_splits) and 1 <= c.num_splits <= 64
                    assert VA.is_pow2(c.block_k) and c.block_k >= 16
                    assert c.num_splits * c.block_k < 2 * span or c.num_splits == 1
    assert VA.choose_config(64, 1, 8, 32768).num_splits >= 16     # batch 1, long context: many splits
    assert max(max_rows for max_rows, *_ in tables.VERIFY_ATTENTION) >= VA.MAX_ROWS   # every tile has a row


def test_rejects_bad_input():
    q, k, v, pt, cl = _problem(0, 1, 2, 4, 2, 16, 16, [5], jnp.float32)
    bad = [
        dict(config=VA.SplitConfig(num_splits=3)),
        dict(config=VA.SplitConfig(block_k=8)),
        dict(q=q[:, :, :3]),               # 3 query heads over 2 KV heads
        dict(q=q[:, 0]),                   # [B, H, hd]: a decode query
        dict(q=jnp.zeros((1, 16, 32, 16)), k=k[:, :1], v=v[:, :1]),   # 512 rows: the op set's fallback, not the kernel
        dict(cl=cl[:0]),
    ]
    for case in bad:
        a = dict(q=q, k=k, v=v, cl=cl, config=None) | case
        with pytest.raises(ValueError):
            VA.paged_verify_attention(a["q"], a["k"], a["v"], 0, pt, a["cl"], 16, 0.25, config=a["config"],
                                      interpret=True)


@pytest.mark.parametrize("H,KVH,Q,B,context,kv_dtype", [
    (32, 8, 4, 1, 8192, jnp.bfloat16),      # Qwen3-4B: 16-row tiles, 64 splits
    (32, 8, 16, 8, 1024, jnp.bfloat16),     # 64-row tiles
    (32, 8, 8, 8, 8192, F8),                # float8 pages
    (32, 4, 16, 1, 1024, jnp.bfloat16),     # group 8: 128-row tiles, eight warps
    (32, 8, 16, 64, 1024, jnp.bfloat16),    # one split: kernel 1 writes the output
], ids=["qwen3-4b-Q4-B1", "qwen3-4b-Q16-B8", "qwen3-4b-Q8-fp8", "group8-Q16", "qwen3-4b-Q16-B64"])
def test_lowers_to_triton_at_real_shapes(monkeypatch, H, KVH, Q, B, context, kv_dtype):
    """Interpret mode never meets the Triton lowering's limits; this lowers the kernels for an H200 (stopping before
    ptxas, as tests/test_triton_lowering.py does)."""
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    hd, ps, L = 128, 16, 2
    P = context // ps
    sd = jax.ShapeDtypeStruct
    cache = sd((L, KVH, (B * P + 1) * ps, hd), kv_dtype)
    config = VA.choose_config(Q * H // KVH, B, KVH, P * ps)

    def verify(q, kc, vc, layer, pt, cl):
        return VA.paged_verify_attention(q, kc, vc, layer, pt, cl, ps, hd ** -0.5, config=config)

    text = jax.jit(verify).trace(sd((B, Q, H, hd), jnp.bfloat16), cache, cache, sd((), jnp.int32),
                                 sd((B, P), jnp.int32), sd((B,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == (2 if config.num_splits > 1 else 1)
