"""The attention kernels with a sliding window, in interpret mode on the CPU, against the reference ops' window.

Fresh random queries, caches and page tables per case (pages in random order). The pages entirely before every
query's window are poisoned in the kernels' cache (NaN keys and values) and their page-table entries point at a
NaN page, as if the engine had freed them and handed them to another sequence: a kernel that read one of them,
masked or not, would return NaN. The reference runs on the clean cache. Windows of 1 (only the token itself), a
few positions, longer than some contexts, and 0 (a global layer through the windowed path); several splits, some
of them entirely before the window.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write
from jaxinfer.pallas import prefill_attention as PA
from jaxinfer.pallas.verify_attention import paged_verify_attention

TOL = 2e-5   # float32, max abs


def _caches(rng, L, KVH, n_pages, ps, hd):
    shape = (L, KVH, n_pages * ps, hd)
    return (jnp.asarray(rng.standard_normal(shape, np.float32)), jnp.asarray(rng.standard_normal(shape, np.float32)))


def _poison(k, v, pages, first, ps, nan_page):
    """(k, v, page table) with every page entirely before `first[b]` filled with NaN and its table entry pointing at
    nan_page (itself NaN)."""
    pages = np.array(pages)
    k, v = np.array(k), np.array(v)
    for b in range(pages.shape[0]):
        for j in range(pages.shape[1]):
            if (j + 1) * ps <= first[b]:
                k[:, :, pages[b, j] * ps:(pages[b, j] + 1) * ps] = np.nan
                v[:, :, pages[b, j] * ps:(pages[b, j] + 1) * ps] = np.nan
                pages[b, j] = nan_page
    k[:, :, nan_page * ps:(nan_page + 1) * ps] = np.nan
    v[:, :, nan_page * ps:(nan_page + 1) * ps] = np.nan
    return jnp.asarray(k), jnp.asarray(v), jnp.asarray(pages)


def _check(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.all(np.isfinite(out)), "a kernel read a page outside the window"
    err = np.max(np.abs(out - ref))
    assert err < TOL, f"max abs error {err:.3e}"


# (B, H, KVH, hd, page_size, context lens, window, num_splits, block_k)
DECODE_CASES = [
    (3, 8, 4, 64, 8, [100, 5, 40], 16, 4, 16),       # a window shorter than one sequence, longer than another
    (2, 16, 2, 128, 16, [300, 77], 33, 8, 32),       # most splits entirely before the window
    (1, 4, 4, 32, 16, [64], 1, 2, 16),               # the token alone
    (2, 8, 2, 64, 16, [90, 17], 0, 4, 16),           # a global layer through the windowed path
    (2, 8, 4, 64, 8, [70, 9], 20, 1, 32),            # one split: kernel 1 writes the output
    (1, 16, 2, 64, 16, [257], 100, 16, 16),          # a window that starts mid-block
]
DECODE_IDS = [f"B{c[0]}-H{c[1]}-KV{c[2]}-hd{c[3]}-ps{c[4]}-W{c[6]}-S{c[7]}-bk{c[8]}" for c in DECODE_CASES]


def _paged_problem(case, KVH, hd, ps, lens):
    """(rng, k, v, page table, lens, a spare page): 2-layer caches, B = len(lens) sequences' pages shuffled, the
    last page left out of every table (for _poison)."""
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    B, P = len(lens), -(-max(lens) // ps) + 1
    n_pages = B * P + 2
    k, v = _caches(rng, 2, KVH, n_pages, ps, hd)
    pages = rng.permutation(np.arange(1, n_pages - 1))[: B * P].reshape(B, P).astype(np.int32)
    return rng, k, v, pages, np.asarray(lens, np.int32), n_pages - 1


def _decode_problem(case):
    B, H, KVH, hd, ps, lens, window, S, bk = case
    rng, k, v, pages, lens, spare = _paged_problem(case, KVH, hd, ps, lens)
    first = np.maximum(lens - window, 0) if window else np.zeros_like(lens)
    return rng, k, v, pages, lens, first, spare


@pytest.mark.parametrize("case", DECODE_CASES, ids=DECODE_IDS)
def test_decode_attention_window(case):
    B, H, KVH, hd, ps, lens, window, S, bk = case
    rng, k, v, pages, lens, first, nan_page = _decode_problem(case)
    q = jnp.asarray(rng.standard_normal((B, H, hd), np.float32))
    layer, scale, w = jnp.int32(1), hd ** -0.5, jnp.int32(window)
    ref = jax.jit(reference.paged_decode_attention, static_argnums=(6, 7))(
        q, k, v, layer, jnp.asarray(pages), jnp.asarray(lens), ps, scale, window=w)
    pk, pv, ppages = _poison(k, v, pages, first, ps, nan_page)
    out = DA.paged_decode_attention(q, pk, pv, layer, ppages, jnp.asarray(lens), ps, scale, window=w,
                                    config=DA.SplitConfig(num_splits=S, block_k=bk), interpret=True)
    _check(out, ref)


@pytest.mark.parametrize("case", DECODE_CASES[:3] + DECODE_CASES[4:5], ids=DECODE_IDS[:3] + DECODE_IDS[4:5])
def test_decode_attention_rope_window(case):
    """The fused kernel (norm, RoPE, cache write, attention): the new token at lens - 1 folded in by split 0."""
    B, H, KVH, hd, ps, lens, window, S, bk = case
    rng, k, v, pages, lens, first, nan_page = _decode_problem(case)
    qkv = jnp.asarray(rng.standard_normal((B, (H + 2 * KVH) * hd), np.float32))
    pos = lens - 1
    slots = jnp.asarray(pages[np.arange(B), pos // ps] * ps + pos % ps)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    cos, sin = reference.rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_freq), jnp.float32)
    qn = jnp.asarray(1 + 0.1 * rng.standard_normal((2, hd), np.float32))
    kn = jnp.asarray(1 + 0.1 * rng.standard_normal((2, hd), np.float32))
    layer, scale, w = jnp.int32(1), hd ** -0.5, jnp.int32(window)

    def ref_op(k, v):
        q, k, v = reference.qkv_rope_write(qkv, (cos, sin), qn[1], kn[1], 1e-6, k, v, layer, slots, H, KVH)
        return reference.paged_decode_attention(q, k, v, layer, jnp.asarray(pages), jnp.asarray(lens), ps, scale,
                                                window=w)

    ref = jax.jit(ref_op)(k, v)
    pk, pv, ppages = _poison(k, v, pages, first, ps, nan_page)
    out, *_ = decode_attention_rope_write(qkv, cos, sin, qn, kn, pk, pv, layer, slots, ppages, jnp.asarray(lens),
                                          page_size=ps, scale=scale, num_heads=H, num_kv_heads=KVH, eps=1e-6,
                                          config=DA.SplitConfig(num_splits=S, block_k=bk), window=w, interpret=True)
    _check(out, ref)


# (H, KVH, hd, page_size, [(prefix, new)] per sequence, window, config)
PREFILL_CASES = [
    (8, 4, 64, 16, [(0, 37), (21, 13), (5, 1)], 8, PA.PrefillConfig(block_q=8, block_k=32)),
    (4, 4, 32, 16, [(45, 60)], 16, PA.PrefillConfig(block_q=16, block_k=16, order="natural")),
    (16, 2, 16, 8, [(3, 50), (0, 7), (40, 24)], 1, PA.PrefillConfig(block_q=4, block_k=16)),
    (8, 4, 64, 16, [(70, 40), (0, 9)], 20, PA.PrefillConfig(block_q=16, block_k=16, heads=1)),
    (8, 2, 32, 16, [(30, 19), (7, 33)], 0, PA.PrefillConfig(block_q=8, block_k=32)),     # global, windowed path
    (8, 2, 32, 8, [(100, 8)], 64, PA.PrefillConfig(block_q=8, block_k=16)),             # unmasked blocks between
]
PREFILL_IDS = [f"H{c[0]}-KV{c[1]}-hd{c[2]}-ps{c[3]}-W{c[5]}-bq{c[6].block_q}-bk{c[6].block_k}" for c in PREFILL_CASES]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=PREFILL_IDS)
def test_prefill_attention_window(case):
    """Ragged chunks after cached prefixes (then padding rows) through the prefill kernel's paged_attention."""
    H, KVH, hd, ps, seqs, window, config = case
    rng, k, v, pages, _, spare = _paged_problem(case, KVH, hd, ps, [a + n for a, n in seqs])
    B = len(seqs)
    n_rows = sum(n for _, n in seqs)
    # padding rows (token_seq 0, position 0, as the engine lays them out) after a second sequence: after sequence 0
    # they would join its rows' programs and see its position 0 (the engine points a freed page's entry at the
    # scratch page, which they may read)
    T = n_rows + (3 if B > 1 else 0)
    q = jnp.asarray(rng.standard_normal((T, H, hd), np.float32))
    positions, token_seq = np.zeros(T, np.int32), np.zeros(T, np.int32)
    t = 0
    for b, (prefix, n) in enumerate(seqs):
        positions[t:t + n], token_seq[t:t + n] = np.arange(prefix, prefix + n), b
        t += n
    # the pages before the first row's window (the lowest of its sequence's rows) are freed
    first = [max(prefix - window + 1, 0) if window else 0 for prefix, _ in seqs]
    layer, scale, w = jnp.int32(1), hd ** -0.5, jnp.int32(window)
    args = (jnp.asarray(token_seq), jnp.asarray(positions), ps, scale)
    ref = jax.jit(reference.paged_attention, static_argnums=(7, 8))(q, k, v, layer, jnp.asarray(pages), *args,
                                                                     window=w)
    pk, pv, ppages = _poison(k, v, pages, first, ps, spare)
    out = PA.paged_attention(q, pk, pv, layer, ppages, *args, config=config, window=w, interpret=True)
    _check(out[:n_rows], ref[:n_rows])


# (B, Q, H, KVH, hd, page_size, context lens (the last row's position + 1), window, num_splits, block_k)
VERIFY_CASES = [
    (2, 4, 8, 4, 64, 16, [100, 9], 16, 4, 16),
    (1, 8, 4, 4, 32, 8, [150], 3, 8, 16),           # a window shorter than the Q rows
    (3, 2, 16, 2, 64, 16, [77, 40, 2], 0, 2, 32),   # global, windowed path
    (2, 5, 4, 2, 32, 16, [90, 64], 24, 1, 32),      # one split
]
VERIFY_IDS = [f"B{c[0]}-Q{c[1]}-H{c[2]}-KV{c[3]}-hd{c[4]}-ps{c[5]}-W{c[7]}-S{c[8]}-bk{c[9]}" for c in VERIFY_CASES]


@pytest.mark.parametrize("case", VERIFY_CASES, ids=VERIFY_IDS)
def test_verify_attention_window(case):
    B, Q, H, KVH, hd, ps, lens, window, S, bk = case
    rng, k, v, pages, lens, spare = _paged_problem(case, KVH, hd, ps, lens)
    q = jnp.asarray(rng.standard_normal((B, Q, H, hd), np.float32))
    first = [max(n - Q + 1 - window, 0) if window else 0 for n in lens]   # row 0's window
    layer, scale, w = jnp.int32(1), hd ** -0.5, jnp.int32(window)
    ref = jax.jit(reference.verify_attention, static_argnums=(6, 7))(q, k, v, layer, jnp.asarray(pages),
                                                                      jnp.asarray(lens), ps, scale, window=w)
    pk, pv, ppages = _poison(k, v, pages, first, ps, spare)
    out = paged_verify_attention(q, pk, pv, layer, ppages, jnp.asarray(lens), ps, scale, window=w,
                                 config=DA.SplitConfig(num_splits=S, block_k=bk), interpret=True)
    _check(out, ref)


# ---- the windowed kernels and engine steps lower to Triton IR for an H200 (tests/test_triton_lowering.py's way) ----

def _lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def h200(monkeypatch):
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))


TRITON_CALL = "custom_call @__gpu$xla.gpu.triton"


@pytest.mark.parametrize("batch,splits", [(1, 16), (8, 1)])
def test_windowed_kernels_lower_at_mistral_shape(h200, batch, splits):
    H, K, hd, ps, L, P, Q = 32, 8, 128, 16, 2, 1024, 4
    sd = jax.ShapeDtypeStruct
    cache = sd((L, K, (batch * P + 1) * ps, hd), jnp.bfloat16)
    rows, pt, i32 = sd((batch,), jnp.int32), sd((batch, P), jnp.int32), sd((), jnp.int32)
    config = DA.SplitConfig(num_splits=splits, block_k=64)

    def fused(qkv, cs, kc, vc, layer, slots, pt, cl, w):
        return decode_attention_rope_write(qkv, cs, cs, None, None, kc, vc, layer, slots, pt, cl, page_size=ps,
                                           scale=hd ** -0.5, num_heads=H, num_kv_heads=K, config=config, window=w)

    assert TRITON_CALL in _lower(fused, sd((batch, (H + 2 * K) * hd), jnp.bfloat16), sd((batch, hd), jnp.bfloat16),
                                 cache, cache, i32, rows, pt, rows, i32)

    def plain(q, kc, vc, layer, pt, cl, w):
        return DA.paged_decode_attention(q, kc, vc, layer, pt, cl, ps, hd ** -0.5, config=config, window=w)

    assert TRITON_CALL in _lower(plain, sd((batch, H, hd), jnp.bfloat16), cache, cache, i32, pt, rows, i32)

    def verify(q, kc, vc, layer, pt, cl, w):
        return paged_verify_attention(q, kc, vc, layer, pt, cl, ps, hd ** -0.5, config=config, window=w)

    assert TRITON_CALL in _lower(verify, sd((batch, Q, H, hd), jnp.bfloat16), cache, cache, i32, pt, rows, i32)

    T = 512
    tok = sd((T,), jnp.int32)

    def prefill(q, kc, vc, layer, pt, seq, pos, w):
        return PA.paged_attention(q, kc, vc, layer, pt, seq, pos, ps, hd ** -0.5, window=w)

    assert TRITON_CALL in _lower(prefill, sd((T, H, hd), jnp.bfloat16), cache, cache, i32, pt, tok, tok, i32)


def test_windowed_engine_steps_lower(h200, tmp_path):
    """Every compiled step of a Qwen3 whose layers 1.. have a window (layer 0 global), straight-line and scanned."""
    from bench.random_model import QWEN3_0_6B, write_random_model
    from jaxinfer.model.config import load_config
    from jaxinfer.model.transformer import split_layers
    from jaxinfer.model.weights import load_params
    from jaxinfer.ops import get_ops
    from jaxinfer.runner.model_runner import ModelRunner
    from jaxinfer.settings import EngineConfig

    small = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 512, "max_position_embeddings": 1024,
             "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}
    d = write_random_model(tmp_path / "m", {**QWEN3_0_6B, **small}, dtype="bfloat16")
    cfg = load_config(d, "bfloat16")
    assert cfg.layer_windows == (0, 64)
    params = load_params(d, cfg, progress=False)
    for unroll in (True, False):
        config = EngineConfig.from_options(max_num_seqs=4, max_num_batched_tokens=64, greedy_mixed_step=True,
                                           fresh_prompt_attention=True, fresh_prompt_min_tokens=32, decode_steps=2,
                                           unroll_layers=unroll).resolved("cpu", False)
        runner = ModelRunner(cfg, split_layers(params) if unroll else params, get_ops("pallas"), config, num_pages=33,
                             max_model_len=256)
        for variant, batch in runner.bucket_calls():
            traced = runner.steps[variant].trace(runner.params, runner.kv, runner.state, batch)
            assert TRITON_CALL in traced.lower(lowering_platforms=("cuda",)).as_text(), variant.name


@pytest.mark.parametrize("case", [DECODE_CASES[0], DECODE_CASES[1]], ids=[DECODE_IDS[0], DECODE_IDS[1]])
def test_int8_cache_decode_window(case):
    """An INT8 cache (values and scales as operands) through the windowed decode kernel, against the reference op
    on the same QuantizedCache; the values and scales of the pages before the window poisoned (int8 values can
    hold no NaN: their scales do)."""
    from jaxinfer.ops.quantized_cache import QuantizedCache, quantize

    B, H, KVH, hd, ps, lens, window, S, bk = case
    rng, k, v, pages, lens, first, nan_page = _decode_problem(case)
    q = jnp.asarray(rng.standard_normal((B, H, hd), np.float32))
    kq, vq = QuantizedCache(*quantize(k)), QuantizedCache(*quantize(v))
    layer, scale, w = jnp.int32(1), hd ** -0.5, jnp.int32(window)
    ref = jax.jit(reference.paged_decode_attention, static_argnums=(6, 7))(
        q, kq, vq, layer, jnp.asarray(pages), jnp.asarray(lens), ps, scale, window=w)
    ks, vs, ppages = _poison(kq.scale[..., None], vq.scale[..., None], pages, first, ps, nan_page)
    out = DA.paged_decode_attention(q, kq.values, vq.values, layer, ppages, jnp.asarray(lens), ps, scale,
                                    k_scale=ks[..., 0], v_scale=vs[..., 0], window=w,
                                    config=DA.SplitConfig(num_splits=S, block_k=bk), interpret=True)
    _check(out, ref)
