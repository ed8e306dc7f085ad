"""The float8 (e4m3) KV cache, `kv_cache_dtype="fp8"`.

Every writer stores `to_cache(x)` (clipped to +-448, then rounded) and every reader casts back to the
compute dtype, on both op sets: so the Pallas kernels (interpret mode) are checked against the
reference ops reading and writing the same float8 caches, and the engine's greedy output is the same
through either op set. Against a full-precision cache the output is close, not equal: e4m3 keeps 3
mantissa bits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import STORIES

from jaxinfer import LLM
from jaxinfer.engine.engine import Engine
from jaxinfer.model.kv_cache import kv_cache_dtype, to_cache
from jaxinfer.ops import reference
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas import prefill_attention as PA
from jaxinfer.pallas.blocks import page_compute_dtype, to_compute
from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write
from jaxinfer.pallas.rope_kv_write import qkv_rope_write
from jaxinfer.sampling import SamplingParams

F8 = jnp.float8_e4m3fn


def test_to_cache_clips_then_rounds():
    x = jnp.asarray([0.0, 1.0, -3.3, 447.0, 500.0, -1e6, 1e-3], jnp.float32)
    y = np.asarray(to_cache(x, F8).astype(jnp.float32))
    assert np.all(np.isfinite(y))
    assert y[4] == 448 and y[5] == -448
    inside = np.array([0, 1, 2, 6])
    assert np.array_equal(y[inside], np.asarray(x.astype(F8).astype(jnp.float32))[inside])
    assert to_cache(x, jnp.bfloat16).dtype == jnp.bfloat16      # other dtypes: a plain cast


def test_float8_pages_multiply_in_float16():
    """bf16 queries over float8 pages compute in float16 (exact for e4m3 and for bf16 in f16's range);
    queries beyond f16's range are clipped, not turned into inf."""
    assert page_compute_dtype(F8, jnp.bfloat16) == jnp.float16
    assert page_compute_dtype(jnp.bfloat16, jnp.bfloat16) == jnp.bfloat16
    assert page_compute_dtype(F8, jnp.float32) == jnp.float32
    every_e4m3 = jnp.arange(256, dtype=jnp.uint8).view(F8)
    finite = np.isfinite(np.asarray(every_e4m3.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(every_e4m3.astype(jnp.float16).astype(jnp.float32))[finite],
                                  np.asarray(every_e4m3.astype(jnp.float32))[finite])
    q = jnp.asarray([1e5, -3.0, 1.5e-3, 7e4], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(to_compute(q, jnp.float16), np.float32),
                                  [65504.0, -3.0, np.float32(jnp.bfloat16(1.5e-3)), 65504.0])


def test_kv_cache_dtype_option():
    cfg = type("Cfg", (), {"jnp_dtype": jnp.bfloat16})()
    assert kv_cache_dtype(cfg, "auto") == jnp.bfloat16 and kv_cache_dtype(cfg, "fp8") == F8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype(cfg, "int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(STORIES, kv_cache_dtype="fp16", progress=False)


def _caches(rng, shape, dtype):
    """float8 caches holding values of a bf16 model's K and V (some beyond e4m3's range)."""
    k = rng.standard_normal(shape, np.float32) * 4
    k.flat[:: 97] = 600.0
    v = rng.standard_normal(shape, np.float32)
    return to_cache(jnp.asarray(k, dtype), F8), to_cache(jnp.asarray(v, dtype), F8)


@pytest.mark.parametrize("B, H, K, hd, ps, lens, splits", [(2, 8, 4, 64, 16, [37, 5], 2), (1, 4, 4, 128, 16, [130], 4)])
def test_decode_attention_reads_float8_pages(B, H, K, hd, ps, lens, splits):
    rng = np.random.default_rng(B * 10 + hd)
    dtype = jnp.bfloat16
    P = -(-max(lens) // ps)
    n_pages = B * P + 2
    kc, vc = _caches(rng, (2, K, n_pages * ps, hd), dtype)
    q = jnp.asarray(rng.standard_normal((B, H, hd), np.float32), dtype)
    pt = jnp.asarray(rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32))
    cl = jnp.asarray(np.asarray(lens, np.int32))
    layer = jnp.int32(1)
    ref = reference.paged_decode_attention(q, kc, vc, layer, pt, cl, ps, 0.1)
    cfg = DA.SplitConfig(block_k=16, num_splits=splits)
    out = DA.paged_decode_attention(q, kc, vc, layer, pt, cl, ps, 0.1, config=cfg, interpret=True)
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)


def test_prefill_attention_reads_float8_pages():
    rng = np.random.default_rng(3)
    dtype, H, KVH, hd, ps = jnp.bfloat16, 8, 4, 64, 16
    seqs = [(0, 40), (21, 13)]                      # (cached prefix, new tokens)
    P = max(-(-(a + n) // ps) for a, n in seqs)
    n_pages = len(seqs) * P + 2
    kc, vc = _caches(rng, (2, KVH, n_pages * ps, hd), dtype)
    pt = jnp.asarray(rng.permutation(np.arange(1, n_pages))[: len(seqs) * P].reshape(len(seqs), P).astype(np.int32))
    positions = np.concatenate([np.arange(a, a + n) for a, n in seqs]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, b) for b, (_, n) in enumerate(seqs)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((len(positions), H, hd), np.float32), dtype)
    args = (q, kc, vc, jnp.int32(0), pt, jnp.asarray(token_seq), jnp.asarray(positions), ps, 0.125)
    ref = reference.paged_attention(*args)
    out = PA.paged_attention(*args, interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)


def test_kv_writers_store_the_same_float8_values():
    """rope_kv_write (prefill) and the fused decode kernel write what reference.write_kv writes (the
    kernels normalise and rotate in float32, the reference in bf16: a rounding apart, so a few float8
    values may land one step apart), and nothing overflows to NaN."""
    rng = np.random.default_rng(5)
    dtype, H, K, hd, T, L, layer = jnp.bfloat16, 8, 2, 64, 5, 2, 1
    qkv = jnp.asarray(rng.standard_normal((T, (H + 2 * K) * hd), np.float32) * 300, dtype)   # some K, V > 448
    kc = jnp.zeros((L, K, 64, hd), F8)
    vc = jnp.zeros((L, K, 64, hd), F8)
    slots = jnp.asarray(rng.permutation(64)[:T].astype(np.int32))
    _, rk, rv = reference.qkv_rope_write(qkv, None, None, None, 1e-6, kc, vc, jnp.int32(layer), slots, H, K)
    _, ok, ov = qkv_rope_write(qkv, None, None, None, None, kc, vc, layer, slots, num_heads=H, num_kv_heads=K,
                               interpret=True)
    for ours, ref in ((ok, rk), (ov, rv)):
        assert ours.dtype == F8
        a, b = np.asarray(ours.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
        assert np.all(np.isfinite(a)) and np.abs(a).max() == 448
        assert np.mean(a != b) < 0.01
    # the decode kernel: one new token per sequence, written at its slot and attended to at once
    B, ps = 2, 16
    pt = jnp.asarray(np.array([[1, 2], [3, 4]], np.int32))
    cl = jnp.asarray(np.array([20, 3], np.int32))
    # position cl - 1 of each sequence: 19 -> page pt[0, 1] = 2, offset 3; 2 -> page pt[1, 0] = 3, offset 2
    dslots = jnp.asarray(np.array([2 * ps + 3, 3 * ps + 2], np.int32))
    kc2, vc2 = _caches(rng, (L, K, 6 * ps, hd), dtype)
    qkv1 = jnp.asarray(rng.standard_normal((B, (H + 2 * K) * hd), np.float32) * 100, dtype)
    q, rk2, rv2 = reference.qkv_rope_write(qkv1, None, None, None, 1e-6, kc2, vc2, jnp.int32(layer), dslots, H, K)
    ref_out = reference.paged_decode_attention(q, rk2, rv2, jnp.int32(layer), pt, cl, ps, 0.1)
    out, ok2, ov2 = decode_attention_rope_write(qkv1, None, None, None, None, kc2, vc2, jnp.int32(layer), dslots, pt,
                                                cl, page_size=ps, scale=0.1, num_heads=H, num_kv_heads=K,
                                                interpret=True)
    assert np.array_equal(np.asarray(ok2.astype(jnp.float32)), np.asarray(rk2.astype(jnp.float32)))
    assert np.array_equal(np.asarray(ov2.astype(jnp.float32)), np.asarray(rv2.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=5e-2, rtol=3e-2)


def _greedy(llm, prompts, n=24):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts))]


PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park. They"]


def test_engine_with_a_float8_cache():
    """Both op sets give the same greedy tokens from a float8 cache; the pool takes a quarter of the
    bytes of the float32 model's; the tokens stay close to a full-precision cache's."""
    opts = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, decode_steps=4, progress=False)
    fp8 = LLM(STORIES, kv_cache_dtype="fp8", **opts)
    fp8_pallas = LLM(STORIES, kv_cache_dtype="fp8", ops="pallas-interpret", **opts)
    full = LLM(STORIES, **opts)
    assert fp8.engine.runner.kv.k.dtype == F8 and fp8.engine.kv_bytes * 4 == full.engine.kv_bytes
    a, b, c = _greedy(fp8, PROMPTS), _greedy(fp8_pallas, PROMPTS), _greedy(full, PROMPTS)
    assert a == b
    agree = np.mean([x == y for s, t in zip(a, c) for x, y in zip(s, t)])
    assert agree > 0.8, agree


def test_a_fresh_prompt_reads_its_keys_back_from_a_float8_cache():
    """A fresh prompt's attention takes its K/V from the write only where the cache holds them as computed;
    from a float8 cache it reads them back, as the paged attention does: the paged step's tokens, and its
    logprobs to float32 rounding (1e-5), where K/V as computed (the same model with a 16-bit cache) part from
    them by ~0.1 nats on this prompt (so a fresh step that skipped the float8 rounding would fail here)."""
    opts = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, decode_steps=4, progress=False,
                kv_cache_dtype="fp8", greedy_mixed_step=True, fresh_prompt_min_tokens=16)
    fresh = LLM(STORIES, fresh_prompt_attention=True, **opts)
    paged = LLM(STORIES, **opts)
    unrounded = LLM(STORIES, fresh_prompt_attention=True, **{**opts, "kv_cache_dtype": "auto"})
    ran = []
    call = fresh.engine.runner._call
    fresh.engine.runner._call = lambda variant, *a: (ran.append(variant.name), call(variant, *a))[1]
    prompts = ["Lily and Ben went to the park. They saw a big red ball and"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got, want, far = (llm.generate(prompts, [params])[0] for llm in (fresh, paged, unrounded))
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    np.testing.assert_allclose(got.outputs[0].logprobs, want.outputs[0].logprobs, atol=1e-5)
    assert abs(got.outputs[0].logprobs[0] - far.outputs[0].logprobs[0]) > 1e-2
    assert "mixed-greedy-fresh" in ran


def test_the_commands_pass_the_option_on():
    from jaxinfer.cli import build_parser, engine_settings

    for cmd in ("generate", "chat", "bench", "serve"):
        args = build_parser().parse_args([cmd, "--model", "m", "--kv-cache-dtype", "fp8"] + (["x"] if cmd == "generate" else []))
        assert engine_settings(args)["kv_cache_dtype"] == "fp8"


def test_prefix_hits_and_preemption_with_a_float8_cache():
    """Cached float8 pages hold what a fresh prefill writes, and a preempted sequence recomputes the same
    pages: with prefix-cache hits and a pool too small for everyone, each request's greedy tokens equal
    its tokens alone."""
    opts = dict(kv_cache_dtype="fp8", max_num_batched_tokens=64, progress=False)
    system = "once upon a time there was a little girl named lily. she liked to play in the park. " * 2
    prompts = [system + w for w in ("the dog", "a red ball", "her mom said", "one day", "they went home",
                                    "the sun", "lily saw", "he was sad")]
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    alone = LLM(STORIES, max_num_seqs=1, enable_prefix_caching=False, max_model_len=128, **opts)
    expected = [alone.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    tight = LLM(STORIES, max_num_seqs=8, num_pages=13, max_model_len=128, **opts)   # 12 usable pages
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.prefix_cache_hit_rate > 0
    assert tight.engine.pages.num_free == tight.engine.pages.capacity
