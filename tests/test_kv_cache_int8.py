"""The INT8 KV cache, `kv_cache_dtype="int8"`: int8 values and one float32 scale per cached vector.

Every reference op reading or writing the cache goes through quantized_cache.read_rows / write_rows: so each op on an
int8 cache equals the same op on a float32 cache holding the dequantized values. The Pallas op set runs decode attention
on its kernels (values and scales as operands; the kernels' own tests: tests/test_pallas_decode_attention*.py) and the
other ops on the reference ones. Against a full-precision cache the output is close, not equal.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import STORIES

from jaxinfer import LLM
from jaxinfer.engine.engine import Engine
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kv_cache import KVCache, bytes_per_page, kv_cache_dtype
from jaxinfer.ops import pallas, reference
from jaxinfer.ops.quantized_cache import QuantizedCache, quantize, read_rows, write_rows
from jaxinfer.sampling import SamplingParams


def test_quantize_round_trip_is_within_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 64), np.float32) * rng.uniform(0.01, 50, (3, 5, 1)).astype(np.float32)
    x[1, 2] = 0.0                                          # a zero vector
    x[2, 3, 7] = 1e4                                       # an outlier sets its vector's scale
    values, scale = quantize(jnp.asarray(x))
    assert values.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (3, 5)
    assert np.abs(np.asarray(values, np.int32)).max() == 127 and np.asarray(values).min() >= -127
    assert scale[1, 2] == 1.0 and not np.asarray(values[1, 2]).any()
    np.testing.assert_allclose(np.asarray(scale), np.abs(x).max(-1) / 127 + (np.abs(x).max(-1) == 0), rtol=1e-6)
    back = np.asarray(values, np.float32) * np.asarray(scale)[..., None]
    err = np.abs(back - x).max(-1)
    assert np.all(err <= np.asarray(scale) * (0.5 + 1e-5)), (err / np.asarray(scale)).max()


def test_plain_arrays_read_and_write_as_before():
    rng = np.random.default_rng(1)
    cache = jnp.asarray(rng.standard_normal((2, 2, 32, 8), np.float32), jnp.bfloat16)
    rows = jnp.asarray(rng.standard_normal((3, 2, 8), np.float32))
    slots = jnp.asarray([4, 9, 30], jnp.int32)
    out = write_rows(cache, jnp.int32(1), slots, rows)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[1, :, slots], np.float32),
                                  np.asarray(rows.astype(jnp.bfloat16), np.float32))
    got = read_rows(out, jnp.int32(1), jnp.asarray([[4, 9], [30, 0]]), jnp.float32)
    assert got.shape == (2, 2, 2, 8)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(out[1, :, jnp.asarray([[4, 9], [30, 0]])], np.float32))


def _caches(rng, L, K, slots, hd):
    """(int8 k, v caches filled with quantized random vectors, float32 caches of their dequantized values)."""
    def one(amp):
        x = rng.standard_normal((L, K, slots, hd), np.float32) * rng.uniform(0.1, amp, (L, K, slots, 1))
        values, scale = quantize(jnp.asarray(x, jnp.float32))
        return QuantizedCache(values, scale)
    kq, vq = one(8.0), one(2.0)
    return kq, vq, kq.dequantize(), vq.dequantize()


@pytest.mark.parametrize("B, H, K, hd", [(2, 4, 2, 16), (5, 8, 1, 8)])   # per-sequence and per-token layouts
def test_attention_ops_read_the_dequantized_rows(B, H, K, hd):
    rng = np.random.default_rng(B + hd)
    ps, P, L = 8, 4, 2
    n_pages = B * P + 1
    kq, vq, kf, vf = _caches(rng, L, K, n_pages * ps, hd)
    layer = jnp.int32(1)
    pt = jnp.asarray(rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32))
    lens = jnp.asarray(rng.integers(3, P * ps + 1, B).astype(np.int32))

    def same(f):
        a, b = f(kq, vq), f(kf, vf)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)

    q = jnp.asarray(rng.standard_normal((B, H, hd), np.float32))
    same(lambda k, v: reference.paged_decode_attention(q, k, v, layer, pt, lens, ps, 0.3))
    Q = 3
    qv = jnp.asarray(rng.standard_normal((B, Q, H, hd), np.float32))
    same(lambda k, v: reference.verify_attention(qv, k, v, layer, pt, lens + Q, ps, 0.3))
    positions = jnp.asarray(np.concatenate([np.arange(n - 2, n) for n in np.asarray(lens)]).astype(np.int32))
    token_seq = jnp.repeat(jnp.arange(B, dtype=jnp.int32), 2)
    qp = jnp.asarray(rng.standard_normal((2 * B, H, hd), np.float32))
    same(lambda k, v: reference.paged_attention(qp, k, v, layer, pt, token_seq, positions, ps, 0.3))
    slots = pt[0, 2] * ps + jnp.arange(5, dtype=jnp.int32)
    qc = jnp.asarray(rng.standard_normal((5, H, hd), np.float32))
    same(lambda k, v: reference.prefixed_chunk_attention(qc, k, v, layer, pt[0], jnp.int32(2 * ps), slots, ps, 0.3))
    same(lambda k, v: jnp.stack(reference.gather_kv(k, v, layer, slots, jnp.float32)))


def test_writers_store_each_vector_quantized():
    """qkv_rope_write and decode_qkv_attention write quantize(k), quantize(v) at their slots and leave the rest; the
    decode attention then reads what the float cache of the same values gives."""
    rng = np.random.default_rng(7)
    H, K, hd, ps, L, B = 4, 2, 16, 8, 2, 2
    kq, vq, kf, vf = _caches(rng, L, K, 6 * ps, hd)
    layer = jnp.int32(1)
    qkv = jnp.asarray(rng.standard_normal((B, (H + 2 * K) * hd), np.float32) * 3)
    slots = jnp.asarray([2 * ps + 3, 3 * ps + 2], jnp.int32)
    pt = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    lens = jnp.asarray([ps + 4, 3], jnp.int32)
    q, k2, v2, k, v = reference.qkv_rope_write(qkv, None, None, None, 1e-6, kq, vq, layer, slots, H, K, with_kv=True)
    for cache, before, rows in ((k2, kq, k), (v2, vq, v)):
        values, scale = quantize(rows)
        np.testing.assert_array_equal(np.asarray(cache.values[1, :, slots]), np.asarray(values))
        np.testing.assert_array_equal(np.asarray(cache.scale[1, :, slots]), np.asarray(scale))
        untouched = np.ones(cache.shape[2], bool)
        untouched[np.asarray(slots)] = False
        np.testing.assert_array_equal(np.asarray(cache.values[1][:, untouched]),
                                      np.asarray(before.values[1][:, untouched]))
        np.testing.assert_array_equal(np.asarray(cache.values[0]), np.asarray(before.values[0]))
    out, k3, v3 = reference.decode_qkv_attention(qkv, None, None, None, 1e-6, kq, vq, layer, slots, pt, lens, ps, 0.3,
                                                 H, K)
    np.testing.assert_array_equal(np.asarray(k3.values), np.asarray(k2.values))
    ref = reference.paged_decode_attention(q, k2.dequantize(), v2.dequantize(), layer, pt, lens, ps, 0.3)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_the_pallas_ops_with_an_int8_cache():
    """The cache writers and the decode and verify attention ops take their kernels (the same outputs within float32
    rounding, the same cache bit for bit, an INT8 cache back); prompt attention runs the reference op."""
    rng = np.random.default_rng(11)
    H, K, hd, ps, L, B = 4, 2, 16, 8, 2, 2
    kq, vq, _, _ = _caches(rng, L, K, 6 * ps, hd)
    ops = pallas.make(interpret=True)
    layer = jnp.int32(0)
    pt = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    lens = jnp.asarray([ps + 4, 5], jnp.int32)
    slots = jnp.asarray([2 * ps + 3, 3 * ps + 4], jnp.int32)
    qkv = jnp.asarray(rng.standard_normal((B, (H + 2 * K) * hd), np.float32))
    q = jnp.asarray(rng.standard_normal((B, H, hd), np.float32))
    qv = jnp.asarray(rng.standard_normal((B, 2, H, hd), np.float32))
    token_seq, positions = jnp.asarray([0, 1], jnp.int32), lens - 1
    H32 = 2 * K      # the fused kernel needs hd >= 32: a wider case for it
    qkv32 = jnp.asarray(rng.standard_normal((B, (H32 + 2 * K) * 32), np.float32))
    kq32, vq32, _, _ = _caches(rng, L, K, 6 * ps, 32)
    calls = [("qkv_rope_write", (qkv, None, None, None, 1e-6, kq, vq, layer, slots, H, K), True),
             ("qkv_rope_write", (qkv, None, None, None, 1e-6, kq, vq, layer, slots, H, K, True), True),   # with_kv
             ("decode_qkv_attention", (qkv, None, None, None, 1e-6, kq, vq, layer, slots, pt, lens, ps, 0.3, H, K),
              False),   # hd 16: the reference write, then the split kernel
             ("decode_qkv_attention", (qkv32, None, None, None, 1e-6, kq32, vq32, layer, slots, pt, lens, ps, 0.3,
                                       H32, K), False),   # the fused kernel
             ("paged_decode_attention", (q, kq, vq, layer, pt, lens, ps, 0.3), False),
             ("paged_attention", (q, kq, vq, layer, pt, token_seq, positions, ps, 0.3), True),
             ("verify_attention", (qv, kq, vq, layer, pt, lens, ps, 0.3), False)]
    for name, args, same in calls:
        fresh = lambda: jax.tree.map(lambda a: jnp.copy(a) if isinstance(a, jax.Array) else a, args)
        want = getattr(reference, name)(*fresh())
        got = getattr(ops, name)(*fresh())   # the kernels that write the cache donate it
        assert jax.tree.structure(got) == jax.tree.structure(want), name
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            if same or a.dtype == jnp.int8 or a.shape in (kq.scale.shape, kq32.scale.shape):   # the cache
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=name)


def test_kv_cache_dtype_option_and_page_bytes():
    cfg = ModelConfig(family="qwen3", vocab_size=100, hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8,
                      head_dim=128, intermediate_size=9728, max_position_embeddings=4096, dtype="bfloat16")
    assert kv_cache_dtype(cfg, "int8") == jnp.int8
    # hd + 4 bytes a vector against 2 hd: 1.94x the tokens in the same bytes at hd 128
    int8, bf16 = bytes_per_page(cfg, 16, jnp.int8), bytes_per_page(cfg, 16, jnp.bfloat16)
    assert int8 == 2 * 36 * 16 * 8 * (128 + 4) and bf16 == 2 * 36 * 16 * 8 * 256
    assert 1.9 < bf16 / int8 < 2
    small = dataclasses.replace(cfg, num_layers=2)
    kv = KVCache.allocate(small, 3, 16, jnp.int8)
    assert isinstance(kv.k, QuantizedCache) and kv.k.values.shape == (2, 8, 48, 128) and kv.num_pages == 3
    assert kv.k.values.nbytes + kv.k.scale.nbytes + kv.v.values.nbytes + kv.v.scale.nbytes == \
        3 * bytes_per_page(small, 16, jnp.int8)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, int8"):
        kv_cache_dtype(cfg, "int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(STORIES, kv_cache_dtype="uint8", progress=False)


def _greedy(llm, prompts, n=24):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts))]


PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park. They"]


def test_engine_with_an_int8_cache():
    """Greedy text from an int8 cache stays close to a full-precision cache's, and is the same through the Pallas op
    set (its decode attention on the kernels, in interpret mode); the pool's bytes count the scales."""
    opts = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, decode_steps=4, progress=False)
    int8 = LLM(STORIES, kv_cache_dtype="int8", **opts)
    int8_pallas = LLM(STORIES, kv_cache_dtype="int8", ops="pallas-interpret", **opts)
    full = LLM(STORIES, **opts)
    assert isinstance(int8.engine.runner.kv.k, QuantizedCache)
    cfg = full.engine.cfg
    per_vector = cfg.head_dim + 4, cfg.head_dim * 4        # the float32 model's cache: 4 bytes a value
    assert int8.engine.kv_bytes * per_vector[1] == full.engine.kv_bytes * per_vector[0]
    assert "int8" in int8.engine.summary
    # the same bytes hold hd * 4 / (hd + 4) times the tokens: 2.67x at stories260k's hd 8 (1.94x at hd 128)
    ratio = bytes_per_page(cfg, 16, jnp.float32) / bytes_per_page(cfg, 16, jnp.int8)
    assert ratio == per_vector[1] / per_vector[0]
    assert f"{ratio:.2f}x the tokens of a float32 cache" in int8.engine.summary, int8.engine.summary
    assert "the tokens of" not in full.engine.summary
    a, b, c = _greedy(int8, PROMPTS), _greedy(int8_pallas, PROMPTS), _greedy(full, PROMPTS)
    assert a == b
    agree = np.mean([x == y for s, t in zip(a, c) for x, y in zip(s, t)])
    print(f"int8 KV cache: greedy agreement with the float32 cache {agree:.3f}")
    assert agree > 0.8, agree


def test_the_commands_take_int8():
    from jaxinfer.cli import build_parser, engine_settings

    args = build_parser().parse_args(["generate", "--model", "m", "--kv-cache-dtype", "int8", "x"])
    assert engine_settings(args)["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--kv-cache-dtype", "int4", "x"])


def test_engine_with_an_int8_cache_on_the_fused_kernel(tmp_path):
    """A tiny random Qwen3 of head dim 32, which the fused decode kernel takes (stories260k's 8 does not): greedy
    tokens through the Pallas op set in interpret mode (the new token quantized in the kernel) equal the reference
    ops'."""
    from conftest import TOKENIZERS
    from bench.random_model import QWEN3_0_6B, write_random_model

    tiny = {**QWEN3_0_6B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "max_position_embeddings": 256}
    # weights of std 0.5, not 0.02: the attention moves the logits, so greedy tokens vary
    d = write_random_model(tmp_path / "qwen3", tiny, dtype="float32", std=0.5, tokenizer_dir=TOKENIZERS / "qwen3")
    opts = dict(kv_cache_dtype="int8", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, decode_steps=4,
                progress=False)
    ref, ker = LLM(d, **opts), LLM(d, ops="pallas-interpret", **opts)
    prompts = ["Once upon a time", "The little dog ran"]
    a, b = _greedy(ref, prompts, 16), _greedy(ker, prompts, 16)
    assert a == b
    assert min(len(set(t)) for t in a) > 4       # not a degenerate repeat of a few tokens


@pytest.mark.parametrize("convert", ["cvt", "bits", "prmt"])
@pytest.mark.parametrize("batch,context", [(1, 32768), (8, 1024)])
def test_int8_decode_kernels_lower_to_triton_at_qwen3_4b_shapes(monkeypatch, batch, context, convert):
    """Interpret mode never meets the Triton lowering's limits (tests/test_triton_lowering.py): the int8 kernels (the
    fused one's scalar scale stores, the bit-trick conversion; split, fused, verify and the prompt rows' write) lowered
    for an H200 on the CPU."""
    from jax._src.pallas.triton import gpu_info

    from jaxinfer.pallas import decode_attention as DA
    from jaxinfer.pallas import verify_attention as VA
    from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write
    from jaxinfer.pallas.rope_kv_write import qkv_rope_write

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    H, K, hd, ps, L = 32, 8, 128, 16, 2
    P = context // ps
    sd = jax.ShapeDtypeStruct
    values = sd((L, K, (batch * P + 1) * ps, hd), jnp.int8)
    scales = sd(values.shape[:-1], jnp.float32)
    rows, pt, i32 = sd((batch,), jnp.int32), sd((batch, P), jnp.int32), sd((), jnp.int32)
    config = DA.choose_config(batch, K, P * ps, 1, kv_int8=True)

    def fused(qkv, cs, qn, kc, vc, ks, vs, layer, slots, pt, cl):
        return decode_attention_rope_write(qkv, cs, cs, qn, qn, kc, vc, layer, slots, pt, cl, page_size=ps,
                                           scale=hd ** -0.5, num_heads=H, num_kv_heads=K, config=config, k_scale=ks,
                                           v_scale=vs, int8_convert=convert)

    def plain(q, kc, vc, ks, vs, layer, pt, cl):
        return DA.paged_decode_attention(q, kc, vc, layer, pt, cl, ps, hd ** -0.5, k_scale=ks, v_scale=vs,
                                         config=config, int8_convert=convert)

    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    bf16 = lambda *shape: sd(shape, jnp.bfloat16)
    text = lower(fused, bf16(batch, (H + 2 * K) * hd), bf16(batch, hd), bf16(L, hd), values, values, scales, scales,
                 i32, rows, pt, rows)
    assert text.count("__gpu$xla.gpu.triton") >= 1
    assert "__gpu$xla.gpu.triton" in lower(plain, bf16(batch, H, hd), values, values, scales, scales, i32, pt, rows)

    def verify(q, kc, vc, ks, vs, layer, pt, cl):   # 4 rows a sequence (3 drafts)
        return VA.paged_verify_attention(q, kc, vc, layer, pt, cl, ps, hd ** -0.5, k_scale=ks, v_scale=vs,
                                         int8_convert=convert)

    assert "__gpu$xla.gpu.triton" in lower(verify, bf16(batch, 4, H, hd), values, values, scales, scales, i32, pt, rows)

    def prompt_write(qkv, cs, qn, kc, vc, ks, vs, slots):   # a prompt chunk of 64 rows
        return qkv_rope_write(qkv, cs, cs, qn, qn, kc, vc, 1, slots, num_heads=H, num_kv_heads=K, k_scale=ks,
                              v_scale=vs)

    T = 64
    assert "__gpu$xla.gpu.triton" in lower(prompt_write, bf16(T, (H + 2 * K) * hd), bf16(T, hd), bf16(L, hd), values,
                                           values, scales, scales, sd((T,), jnp.int32))


def test_decode_bench_names_and_counts_the_int8_cache(tmp_path):
    """bench/decode.py: "-int8kv" names a path's int8 cache (its bytes: a byte a value and a 4-byte scale a vector), and
    --kv int8 runs each path again with it, on the CPU at a tiny shape (figures meaningless here)."""
    import json
    import os
    import subprocess
    import sys

    from bench import decode

    assert decode.kv_of("pallas+int8-int8kv") == "int8" and decode.kv_of("pallas-fp8") == "fp8"
    assert decode.kv_of("pallas+int8") == "auto"
    assert decode.without_kv("pallas+int8-int8kv") == "pallas+int8"
    assert decode.quantization_of("pallas+int8-int8kv") == "int8"
    cfg = ModelConfig(family="qwen3", vocab_size=100, hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8,
                      head_dim=128, intermediate_size=9728, max_position_embeddings=4096, dtype="bfloat16")
    assert decode.kv_item_bytes(cfg, "int8") == 1 + 4 / 128 and decode.kv_item_bytes(cfg, "auto") == 2
    repo = Path(__file__).resolve().parents[1]
    argv = ["--models", str(tmp_path / "models"), "--out", str(tmp_path), "--shapes", "tiny", "--long", "--paths",
            "reference", "--kv", "int8", "--prompt", "24", "--new", "5", "--steps", "4"]
    r = subprocess.run([sys.executable, str(repo / "bench" / "decode.py"), *argv], capture_output=True, text=True,
                       timeout=300, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert [row["path"] for row in rows] == ["reference", "reference-int8kv"]
    assert rows[1]["roofline_ms"] < rows[0]["roofline_ms"] and rows[1]["speedup_vs_bf16_kv"] > 0
    assert rows[1]["greedy_match_vs_reference"] == 5   # against the reference of the same cache: itself


# (B, Q, H, KVH, hd, page_size, context lens, num_splits, block_k, query dtype): tests/test_pallas_verify_attention.py's
VERIFY_CASES = [
    (3, 8, 8, 2, 64, 8, [100, 9, 3], 8, 16, jnp.float32),      # group 4, pages of 8; context 3 < Q
    (2, 16, 4, 2, 64, 16, [20, 33], 2, 16, jnp.float32),       # rows of sequence 0 that see no split-1 block
    (2, 4, 16, 2, 48, 16, [50, 21], 1, 32, jnp.float32),       # hd 48 (masked columns), one split
    (2, 4, 8, 4, 128, 16, [130, 37], 2, 32, jnp.bfloat16),     # f16 products
]


@pytest.mark.parametrize("convert", ["cvt", "bits"])
@pytest.mark.parametrize("case", VERIFY_CASES, ids=[f"B{c[0]}-Q{c[1]}-hd{c[4]}-S{c[7]}-{jnp.dtype(c[9]).name}"
                                                    for c in VERIFY_CASES])
def test_verify_kernel_reads_the_int8_cache(case, convert):
    """pallas/verify_attention.py with an INT8 cache's values and scales against reference.verify_attention on the
    same QuantizedCache (vectors of magnitudes 1e-3..10): within 2e-5 (float32) or 2e-2 (bf16) of values up to ~10."""
    from jaxinfer.pallas import verify_attention as VA

    B, Q, H, K, hd, ps, lens, S, bk, dtype = case
    rng = np.random.default_rng(sum(lens) + hd)
    P = -(-max(lens) // ps)
    n_pages = B * P + 2
    shape = (2, K, n_pages * ps, hd)
    cache = lambda: QuantizedCache(*quantize(jnp.asarray(rng.standard_normal(shape, np.float32)
                                                         * 10.0 ** rng.uniform(-3, 1, shape[:-1] + (1,)))))
    kq, vq = cache(), cache()
    q = jnp.asarray(rng.standard_normal((B, Q, H, hd), np.float32), dtype)
    pt = jnp.asarray(rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32))
    cl = jnp.asarray(lens, jnp.int32)
    layer = jnp.int32(1)
    ref = jax.jit(reference.verify_attention, static_argnums=(6, 7))(q, kq, vq, layer, pt, cl, ps, hd ** -0.5)
    out = VA.paged_verify_attention(q, kq.values, vq.values, layer, pt, cl, ps, hd ** -0.5, k_scale=kq.scale,
                                    v_scale=vq.scale, config=VA.SplitConfig(S, bk), int8_convert=convert,
                                    interpret=True)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out))
    err = np.abs(out - ref).max() / 10
    assert err < (2e-5 if dtype == jnp.float32 else 2e-2), err


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T, H, K, hd, norm, rope, tiled, with_kv", [
    (1, 8, 4, 16, True, True, 8, False),       # one token
    (19, 4, 2, 16, True, True, 8, True),       # tokens past the tiles' end masked; the k, v written returned
    (9, 4, 2, 24, False, False, 16, False),    # halves of 12 in 16 columns: the padding outside the scale
    (5, 16, 2, 64, True, False, 8, False)])
def test_prompt_rows_write_the_int8_cache(T, H, K, hd, norm, rope, tiled, with_kv, dtype):
    """pallas/rope_kv_write.py with an INT8 cache against reference.qkv_rope_write on the same QuantizedCache: q and
    the returned k, v as tests/test_pallas_rope_kv_write.py holds them; the written values within one step of the
    reference's (its norm and RoPE may round k an ulp apart; in float32 without them equal), their scales within that
    rounding; nothing else touched."""
    from jaxinfer.ops import LayerWeight
    from jaxinfer.pallas.rope_kv_write import qkv_rope_write

    L, layer, slots = 3, 2, 64
    rng = np.random.default_rng(T * 100 + hd)
    qkv = jnp.asarray(rng.standard_normal((T, (H + 2 * K) * hd), np.float32) * 3, dtype)
    kq, vq, _, _ = _caches(rng, L, K, slots, hd)
    qn = jnp.asarray(1 + 0.2 * rng.standard_normal((L, hd)), dtype) if norm else None
    kn = jnp.asarray(1 + 0.2 * rng.standard_normal((L, hd)), dtype) if norm else None
    positions = jnp.asarray(rng.integers(0, 500, T))
    cos_sin = reference.rope_cos_sin(positions, 1.0 / (10000 ** (jnp.arange(0, hd, 2) / hd)), dtype) if rope else None
    slot_mapping = jnp.asarray(rng.permutation(slots)[:T].astype(np.int32))
    lw = (lambda a: None if a is None else LayerWeight(a, jnp.int32(layer)))
    ref = reference.qkv_rope_write(qkv, cos_sin, lw(qn), lw(kn), 1e-6, kq, vq, jnp.int32(layer), slot_mapping, H, K,
                                   with_kv=with_kv)
    cos, sin = cos_sin if rope else (None, None)
    ours = qkv_rope_write(qkv, cos, sin, qn, kn, kq.values + 0, vq.values + 0, layer, slot_mapping, num_heads=H,
                          num_kv_heads=K, eps=1e-6, interpret=True, with_kv=with_kv, tiled=tiled,
                          k_scale=kq.scale + 0, v_scale=vq.scale + 0)
    assert len(ours) == 5 + 2 * with_kv and len(ref) == 3 + 2 * with_kv
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for a, b in [(ours[0], ref[0])] + list(zip(ours[5:], ref[3:])):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape and np.linalg.norm(a - b) <= tol * np.linalg.norm(b)
    written = np.zeros((L, K, slots), bool)
    written[layer, :, np.asarray(slot_mapping)] = True
    exact = dtype == jnp.float32 and not norm and not rope   # k as the reference computes it, bit for bit
    for values, scale, want in ((ours[1], ours[3], ref[1]), (ours[2], ours[4], ref[2])):
        a, b = np.asarray(values, np.int32), np.asarray(want.values, np.int32)
        np.testing.assert_array_equal(a[~written], b[~written])
        np.testing.assert_array_equal(np.asarray(scale)[~written], np.asarray(want.scale)[~written])
        assert np.abs(a[written] - b[written]).max() <= (0 if exact else 1)
        np.testing.assert_allclose(np.asarray(scale)[written], np.asarray(want.scale)[written],
                                   rtol=0 if exact else 1e-2 if dtype == jnp.bfloat16 else 1e-6)


def test_engine_steps_lower_to_triton_with_an_int8_cache(monkeypatch, tmp_path):
    """Every compiled step of a Pallas engine with an INT8 cache (unrolled layers, a tiny Qwen3 of head dim 128)
    lowers for an H200 on the CPU, the decode steps through the int8 kernels."""
    from jax._src.pallas.triton import gpu_info

    from bench.random_model import QWEN3_0_6B, write_random_model
    from jaxinfer.model.config import load_config
    from jaxinfer.model.transformer import split_layers
    from jaxinfer.model.weights import load_params
    from jaxinfer.ops import get_ops
    from jaxinfer.runner.model_runner import ModelRunner
    from jaxinfer.settings import EngineConfig

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    small = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 512, "max_position_embeddings": 1024}
    d = write_random_model(tmp_path / "m", {**QWEN3_0_6B, **small}, dtype="bfloat16")
    cfg = load_config(d, "bfloat16")
    config = EngineConfig.from_options(max_num_seqs=4, max_num_batched_tokens=64, unroll_layers=True,
                                       decode_steps=2).resolved("cpu", False)
    runner = ModelRunner(cfg, split_layers(load_params(d, cfg, progress=False)), get_ops("pallas"), config,
                         num_pages=33, max_model_len=256, kv_dtype=jnp.int8)
    assert isinstance(runner.kv.k, QuantizedCache)
    calls = runner.bucket_calls()
    assert any("decode" in v.name for v, _ in calls), [v.name for v, _ in calls]
    for variant, batch in calls:
        text = runner.steps[variant].trace(runner.params, runner.kv, runner.state, batch).lower(
            lowering_platforms=("cuda",)).as_text()
        if "decode" in variant.name:
            assert "decode_attention_rope_split" in text, variant.name
