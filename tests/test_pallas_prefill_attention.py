"""Paged prefill (flash) attention (jaxinfer/pallas/prefill_attention.py) in interpret mode on the CPU,
against reference.paged_attention.

Each case is several ragged sequences in one call, each a chunk of `new` tokens after a `prefix`
already in the cache (prefixes that end mid-page, chunks that start at position > 0, lengths that are
not multiples of the blocks, a single-token chunk), pages in random order (never contiguous), padding
rows after the last sequence, fresh random q, K, V. GQA 8/4, 4/4, 16/2 and a group of 3; hd 16, 24
(masked columns), 64, 128. Tolerance (max abs error where |ref| <= 1, relative above; outputs are
O(0.1-1), up to ~4 for rows that see few keys): float32 1e-5 (measured ~1e-6); bfloat16 2e-2 (the kernel rounds the unnormalised probabilities to bf16 before p @ v where the reference rounds
the normalised ones; both round the output: a few bf16 ulps). Padding rows must be finite (zeros).
"""

import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.pallas import prefill_attention as PA

TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}
# One compile per case instead of one per op.
ref_op = jax.jit(reference.paged_attention, static_argnums=(7, 8))


def _problem(seed, H, KVH, hd, page_size, seqs, dtype, pad=3, extra_pages=0, L=2):
    """seqs: [(prefix, new)]. Returns q, k, v, page_table, query_start, token_seq, positions, n_rows.
    Rows are laid out as the engine does: each sequence's chunk contiguous, then `pad` padding rows
    (token_seq 0, position 0)."""
    rng = np.random.default_rng(seed)
    B = len(seqs)
    P = max(-(-(a + n) // page_size) for a, n in seqs) + extra_pages
    n_pages = B * P + 2                 # page 0 is scratch and one page is spare: never in a table here
    shape = (L, KVH, n_pages * page_size, hd)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    pages = rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32)
    n_rows = sum(n for _, n in seqs)
    T = n_rows + pad
    q = jnp.asarray(rng.standard_normal((T, H, hd), np.float32), dtype)
    positions = np.zeros(T, np.int32)
    token_seq = np.zeros(T, np.int32)
    query_start = [0]
    for b, (prefix, n) in enumerate(seqs):
        t = query_start[-1]
        positions[t:t + n] = np.arange(prefix, prefix + n)
        token_seq[t:t + n] = b
        query_start.append(t + n)
    return (q, k, v, jnp.asarray(pages), jnp.asarray(np.asarray(query_start, np.int32)), jnp.asarray(token_seq),
            jnp.asarray(positions), n_rows)


def _check(out, ref, dtype, n_rows):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.all(np.isfinite(out)), "non-finite output"
    # Absolute below 1, relative above (bf16 outputs near a single visible v row reach |3-4|).
    err = np.max(np.abs(out[:n_rows] - ref[:n_rows]) / np.maximum(1.0, np.abs(ref[:n_rows])))
    assert err < TOL[jnp.dtype(dtype)], f"max error {err:.3e}"


# (H, KVH, hd, page_size, [(prefix, new)], config)
CASES = [
    (8, 4, 64, 16, [(0, 37), (21, 13), (5, 1)], PA.PrefillConfig(block_q=8, block_k=32)),
    (4, 4, 128, 16, [(45, 60)], PA.PrefillConfig(block_q=16, block_k=16, order="natural")),
    (16, 2, 16, 8, [(3, 50), (0, 7), (40, 24)], PA.PrefillConfig(block_q=4, block_k=16)),
    (8, 4, 64, 16, [(13, 40), (0, 9)], PA.PrefillConfig(block_q=16, block_k=16, heads=1)),
    (16, 2, 16, 16, [(30, 19), (7, 33)], PA.PrefillConfig(block_q=8, block_k=32, heads=2)),
    (12, 4, 24, 8, [(9, 22), (0, 15), (17, 1)], PA.PrefillConfig(block_q=8, block_k=16)),   # group 3, hd 24
    (8, 4, 64, 4, [(0, 5), (2, 3)], PA.PrefillConfig(block_q=16, block_k=64)),            # short, page 4
]
IDS = [f"H{c[0]}-KV{c[1]}-hd{c[2]}-ps{c[3]}-bq{c[5].block_q}-bk{c[5].block_k}-h{c[5].heads}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32(case):
    H, KVH, hd, ps, seqs, cfg = case
    q, k, v, pt, qs, ts, pos, n = _problem(zlib.crc32(repr(case).encode()), H, KVH, hd, ps, seqs, jnp.float32)
    layer = jnp.int32(1)
    ref = ref_op(q, k, v, layer, pt, ts, pos, ps, hd ** -0.5)
    out = PA.paged_prefill_attention(q, k, v, layer, pt, qs, pos, ps, hd ** -0.5, config=cfg, interpret=True)
    _check(out, ref, jnp.float32, n)
    assert np.all(np.asarray(out[n:]) == 0)          # padding rows: zeros


@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=[IDS[0], IDS[1]])
def test_bfloat16(case):
    H, KVH, hd, ps, seqs, cfg = case
    q, k, v, pt, qs, ts, pos, n = _problem(zlib.crc32(repr(case).encode()) + 1, H, KVH, hd, ps, seqs,
                                           jnp.bfloat16)
    layer = jnp.int32(0)
    ref = ref_op(q, k, v, layer, pt, ts, pos, ps, hd ** -0.5)
    out = PA.paged_prefill_attention(q, k, v, layer, pt, qs, pos, ps, hd ** -0.5, config=cfg, interpret=True)
    _check(out, ref, jnp.bfloat16, n)


def test_reference_signature_adapter_engine_layout():
    """paged_attention(token_seq=...) equals the reference on every row, padding rows included (they are
    rows of sequence 0 at position 0 for both); with one sequence the padding run joins its segment.
    (The shapes and configs of CASES[0] and CASES[1], so the compiled kernels are reused.)"""
    for H, KVH, hd, ps, seqs, cfg in (CASES[0], CASES[1]):
        q, k, v, pt, _, ts, pos, _ = _problem(len(seqs) + 99, H, KVH, hd, ps, seqs, jnp.float32)
        ref = ref_op(q, k, v, jnp.int32(1), pt, ts, pos, ps, hd ** -0.5)
        out = PA.paged_attention(q, k, v, jnp.int32(1), pt, ts, pos, ps, hd ** -0.5, config=cfg, interpret=True)
        _check(out, ref, jnp.float32, out.shape[0])


def test_table_choice_under_jit_wide_page_table():
    """The default config, layer traced, a precomputed schedule, a page table much wider than the sequences
    (as the engine pads it), and empty padding sequences in query_start (query_start[b] == query_start[b + 1])."""
    H, KVH, hd, ps = 8, 4, 64, 16
    q, k, v, pt, qs, ts, pos, n = _problem(11, H, KVH, hd, ps, [(40, 24), (0, 3), (100, 9)], jnp.float32,
                                           extra_pages=12)
    pt = jnp.concatenate([pt, jnp.zeros((2, pt.shape[1]), jnp.int32)])     # two padding sequences
    qs = jnp.concatenate([qs, jnp.full((2,), qs[-1], jnp.int32)])
    cfg = PA.choose_config(q.shape[0], H, KVH, hd)

    def f(q, k, v, layer, pt, qs, pos):                  # the schedule made once, as a step would
        sched = PA.prefill_schedule(qs, pos, q.shape[0], cfg.block_q)
        return PA.paged_prefill_attention(q, k, v, layer, pt, qs, pos, ps, hd ** -0.5, schedule=sched,
                                          interpret=True)

    out = jax.jit(f)(q, k, v, jnp.int32(1), pt, qs, pos)
    ref = ref_op(q, k, v, jnp.int32(1), pt, ts, pos, ps, hd ** -0.5)
    _check(out, ref, jnp.float32, n)


def test_poisoned_invisible_slots_give_reference_answer():
    """NaN/inf in every slot that no row may see (past each sequence's last position, the spare page, the
    scratch page): no NaN, and the reference's answer from the clean cache. (CASES[0]'s shapes.)"""
    H, KVH, hd, ps, seqs, cfg = CASES[0]
    q, k, v, pt, qs, ts, pos, n = _problem(5, H, KVH, hd, ps, seqs, jnp.float32)
    slots = np.asarray(pt)[:, :, None] * ps + np.arange(ps)
    visible = np.zeros(k.shape[2], bool)
    for b, (prefix, new) in enumerate(seqs):
        visible[slots[b].reshape(-1)[:prefix + new]] = True
    poison = np.where(np.arange(k.shape[2]) % 2 == 0, np.nan, np.inf).astype(np.float32)
    mask = jnp.asarray(visible)[None, None, :, None]
    k_bad = jnp.where(mask, k, jnp.asarray(poison)[None, None, :, None])
    v_bad = jnp.where(mask, v, -jnp.asarray(poison)[None, None, :, None])
    ref = ref_op(q, k, v, jnp.int32(1), pt, ts, pos, ps, hd ** -0.5)
    out = PA.paged_prefill_attention(q, k_bad, v_bad, jnp.int32(1), pt, qs, pos, ps, hd ** -0.5, config=cfg,
                                     interpret=True)
    _check(out, ref, jnp.float32, n)


def _covered_rows(sched, block_q, T):
    """Rows of each program of a schedule [3, N] (numpy), as a list of (seq, rows)."""
    out = []
    for seq, row0, row_end in np.asarray(sched).T:
        if row0 < row_end:
            out.append((int(seq), list(range(row0, min(row0 + block_q, row_end)))))
    return out


@pytest.mark.parametrize("order", ["work", "natural"])
def test_schedule_covers_every_row_once(order):
    """Random ragged layouts (empty sequences, padding rows, query_start[0] > 0): each row in exactly one
    program, of its own sequence (rows outside the sequences: -1), no program crossing a sequence
    boundary, all within the static bound T // block_q + B + 2; with order "work", most keys first."""
    rng = np.random.default_rng(0)
    B, T = 5, 96
    for trial in range(40):
        lens = rng.integers(0, 24, B)
        head = int(rng.integers(0, 3)) if trial % 4 == 0 else 0
        qs = np.concatenate([[head], head + np.cumsum(lens)]).astype(np.int32)
        pos = rng.integers(0, 100, T).astype(np.int32)
        bq = [1, 4, 16][trial % 3]
        sched = np.asarray(PA.prefill_schedule(jnp.asarray(qs), jnp.asarray(pos), T, bq, order))
        assert sched.shape == (3, T // bq + B + 2)
        seen = np.zeros(T, int)
        progs = _covered_rows(sched, bq, T)
        for seq, rows in progs:
            for t in rows:
                seen[t] += 1
                want = int(np.searchsorted(qs, t, side="right")) - 1 if qs[0] <= t < qs[-1] else -1
                assert seq == want
        assert np.all(seen == 1), (trial, seen)
        if order == "work":
            work = [pos[rows[-1]] + 1 if seq >= 0 else 0 for seq, rows in progs]
            assert work == sorted(work, reverse=True)


def test_schedule_from_token_seq_engine_layout():
    rng = np.random.default_rng(1)
    B, T = 4, 80
    for _ in range(20):
        n_seqs = int(rng.integers(1, B + 1))
        lens = rng.integers(1, 20, n_seqs)
        ts = np.zeros(T, np.int32)
        ts[: lens.sum()] = np.repeat(np.arange(n_seqs), lens)
        pos = rng.integers(0, 50, T).astype(np.int32)
        sched = PA.schedule_from_token_seq(jnp.asarray(ts), jnp.asarray(pos), B, 8)
        assert sched.shape == (3, T // 8 + B + 2)
        seen = np.zeros(T, int)
        for seq, rows in _covered_rows(sched, 8, T):
            for t in rows:
                seen[t] += 1
                assert seq == ts[t]
        assert np.all(seen == 1)


def test_choose_config_shapes():
    for T in (1, 16, 128, 1024, 8192, 32768):
        for H, KVH, hd in ((32, 8, 128), (16, 8, 128), (32, 32, 128), (28, 4, 128), (12, 2, 64), (8, 8, 256)):
            c = PA.choose_config(T, H, KVH, hd)
            group = H // KVH
            heads = PA.heads_per_program(c, group)
            assert group % heads == 0
            assert PA.is_pow2(c.block_q) and PA.is_pow2(c.block_k) and c.block_k >= 16
            assert c.block_q * PA.pow2_at_least(heads) >= 16


def test_rejects_bad_configs():
    q, k, v, pt, qs, _, pos, _ = _problem(0, 8, 4, 16, 16, [(0, 5)], jnp.float32)
    for cfg in (PA.PrefillConfig(block_q=24), PA.PrefillConfig(block_k=8), PA.PrefillConfig(heads=3),
                PA.PrefillConfig(block_q=4, heads=1), PA.PrefillConfig(order="random")):
        with pytest.raises(ValueError):
            PA.paged_prefill_attention(q, k, v, 0, pt, qs, pos, 16, 0.25, config=cfg, interpret=True)
    with pytest.raises(ValueError):
        PA.paged_prefill_attention(q[:, :3], k, v, 0, pt, qs, pos, 16, 0.25, interpret=True)
    with pytest.raises(ValueError):
        PA.paged_prefill_attention(q, k, v, 0, pt, qs[:-1], pos, 16, 0.25, interpret=True)
    with pytest.raises(ValueError):                      # a schedule made for another block_q
        PA.paged_prefill_attention(q, k, v, 0, pt, qs, pos, 16, 0.25, config=PA.PrefillConfig(block_q=16),
                                   schedule=PA.prefill_schedule(qs, pos, q.shape[0], 4), interpret=True)


def test_lowers_to_triton_at_qwen3_4b_shape():
    """Every configuration the table gives Qwen3-4B lowers to Triton IR for an H200 (sm_90), from the CPU:
    catches unsupported primitives and bad load/store indexing before any GPU run. (Compiling that IR to
    a GPU binary, and so register use and spills, is left to the GPU.)"""
    try:
        from jax._src.pallas.triton import gpu_info
        from jax._src.pallas.triton import pallas_call_registration as reg
        h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    except (ImportError, AttributeError) as e:                 # private API moved: nothing to check here
        pytest.skip(f"jax internals changed: {e}")
    T, H, KVH, hd, B, ps = 1024, 32, 8, 128, 2, 16
    sds = jax.ShapeDtypeStruct
    args = (sds((T, H, hd), jnp.bfloat16), sds((36, KVH, 1024 * ps, hd), jnp.bfloat16),
            sds((36, KVH, 1024 * ps, hd), jnp.bfloat16), sds((), jnp.int32), sds((B, 512), jnp.int32),
            sds((B + 1,), jnp.int32), sds((T,), jnp.int32))
    configs = sorted({PA.choose_config(t, H, KVH, hd) for t in (16, 128, 1024, 8192, 32768)}, key=lambda c: c.astuple())
    saved = reg.gpu_info_lib.get_gpu_info
    reg.gpu_info_lib.get_gpu_info = lambda: h200
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for cfg in configs:
                f = jax.jit(lambda *a, cfg=cfg: PA.paged_prefill_attention(*a, ps, hd ** -0.5, config=cfg))
                text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                assert "__gpu$xla.gpu.triton" in text, cfg
    finally:
        reg.gpu_info_lib.get_gpu_info = saved
