"""Sliding-window attention on the GPU: the kernels at Mistral-7B's shape against the reference ops' window, and
the Pallas engine's greedy tokens on the tiny sliding-window models against transformers'.

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_sliding_window_gpu.py
Kernels: H 32, KVH 8, hd 128, window 4,096, bf16, pages of 16 in random order; contexts of 1-4x the window (and
shorter than it); the decode kernel (batch 1 and 8), the fused RoPE decode kernel, the prefill kernel (a chunk of
1,024 rows after a cached prefix, and two sequences) and the verify kernel (Q 4); the pages entirely before the
window poisoned with NaN and their table entries pointing at a NaN page (as if freed and handed on): a kernel that
read one would return NaN. Tolerance: relative Frobenius error 2e-2 in bf16 (tests/gpu/test_decode_attention_gpu.py).
Engine: float32, Pallas ops with the GPU's defaults, 32 greedy tokens after prompts of 1-4x the window (16).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas import prefill_attention as PA
from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write
from jaxinfer.pallas.verify_attention import paged_verify_attention

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

PS, H, KVH, HD, W = 16, 32, 8, 128, 4096
TOL = 2e-2


def _problem(seed, B, max_ctx):
    P = -(-max_ctx // PS) + 1
    n_pages = B * P + 2
    kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (2, KVH, n_pages * PS, HD)
    k, v = jax.random.normal(kk, shape, jnp.bfloat16), jax.random.normal(kv, shape, jnp.bfloat16)
    pages = np.asarray(jax.random.permutation(kp, jnp.arange(1, n_pages - 1, dtype=jnp.int32))[: B * P]).reshape(B, P)
    return k, v, pages, n_pages - 1


def _poison(k, v, pages, first, nan_page):
    """The caches with every page entirely before first[b] (and nan_page) NaN, and a table pointing those at it."""
    pages = np.array(pages)
    dead = [int(pages[b, j]) for b in range(len(first)) for j in range(pages.shape[1]) if (j + 1) * PS <= first[b]]
    for b in range(len(first)):
        pages[b, :max(first[b], 0) // PS] = nan_page
    slots = np.concatenate([np.arange(p * PS, (p + 1) * PS) for p in dead + [nan_page]])
    k, v = k.at[:, :, slots].set(jnp.nan), v.at[:, :, slots].set(jnp.nan)
    return k, v, jnp.asarray(pages)


def _check(out, ref):
    out, ref = np.asarray(out.astype(jnp.float32), np.float64), np.asarray(ref.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "a kernel read a page outside the window"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("B,lens", [(1, [16384]), (1, [8192]), (8, [16384, 12000, 4096, 4097, 100, 9000, 1, 16000])])
def test_decode_kernels(B, lens):
    k, v, pages, nan_page = _problem(B, B, max(lens))
    cl = jnp.asarray(lens, jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(7), (B, H, HD), jnp.bfloat16)
    w, layer = jnp.int32(W), jnp.int32(1)
    ref = jax.jit(reference.paged_decode_attention, static_argnums=(6, 7))(q, k, v, layer, jnp.asarray(pages), cl,
                                                                           PS, HD ** -0.5, window=w)
    first = [max(n - W, 0) for n in lens]
    pk, pv, ppages = _poison(k, v, pages, first, nan_page)
    _check(DA.paged_decode_attention(q, pk, pv, layer, ppages, cl, PS, HD ** -0.5, window=w), ref)

    # the fused kernel: the new token at lens - 1 (its slot written by the kernel)
    qkv = jax.random.normal(jax.random.PRNGKey(8), (B, (H + 2 * KVH) * HD), jnp.bfloat16)
    pos = np.asarray(lens) - 1
    slots = jnp.asarray(pages[np.arange(B), pos // PS] * PS + pos % PS)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, HD, 2, dtype=np.float32) / HD))
    cos, sin = reference.rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_freq), jnp.bfloat16)

    def ref_op(k, v):
        qr, k, v = reference.qkv_rope_write(qkv, (cos, sin), None, None, 1e-6, k, v, layer, slots, H, KVH)
        return reference.paged_decode_attention(qr, k, v, layer, jnp.asarray(pages), cl, PS, HD ** -0.5, window=w)

    ref = jax.jit(ref_op)(k, v)
    out, *_ = decode_attention_rope_write(qkv, cos, sin, None, None, pk, pv, layer, slots, ppages, cl, page_size=PS,
                                          scale=HD ** -0.5, num_heads=H, num_kv_heads=KVH, window=w)
    _check(out, ref)


@pytest.mark.parametrize("seqs", [[(15360, 1024)], [(0, 8192)], [(6000, 700), (200, 300)]])
def test_prefill_kernel(seqs):
    B = len(seqs)
    k, v, pages, nan_page = _problem(len(seqs) + 10, B, max(a + n for a, n in seqs))
    positions = np.concatenate([np.arange(a, a + n) for a, n in seqs]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, b) for b, (_, n) in enumerate(seqs)]).astype(np.int32)
    q = jax.random.normal(jax.random.PRNGKey(9), (len(positions), H, HD), jnp.bfloat16)
    w, layer = jnp.int32(W), jnp.int32(1)
    args = (jnp.asarray(token_seq), jnp.asarray(positions), PS, HD ** -0.5)
    ref = jax.jit(reference.paged_attention, static_argnums=(7, 8))(q, k, v, layer, jnp.asarray(pages), *args,
                                                                     window=w)
    pk, pv, ppages = _poison(k, v, pages, [max(a - W + 1, 0) for a, _ in seqs], nan_page)
    _check(PA.paged_attention(q, pk, pv, layer, ppages, *args, window=w), ref)


def test_verify_kernel():
    B, Q = 8, 4
    lens = [16384, 12000, 4096, 4100, 100, 9000, 5, 16000]
    k, v, pages, nan_page = _problem(20, B, max(lens))
    cl = jnp.asarray(lens, jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(10), (B, Q, H, HD), jnp.bfloat16)
    w, layer = jnp.int32(W), jnp.int32(1)
    ref = jax.jit(reference.verify_attention, static_argnums=(6, 7))(q, k, v, layer, jnp.asarray(pages), cl, PS,
                                                                     HD ** -0.5, window=w)
    pk, pv, ppages = _poison(k, v, pages, [max(n - Q + 1 - W, 0) for n in lens], nan_page)
    _check(paged_verify_attention(q, pk, pv, layer, ppages, cl, PS, HD ** -0.5, window=w), ref)


@pytest.mark.parametrize("family", ["mistral_swa", "qwen2_swa"])
def test_engine_greedy_matches_transformers(family):
    from conftest import DATA
    from jaxinfer import LLM, SamplingParams

    golden = np.load(DATA / "golden" / f"{family}.npz")
    llm = LLM(DATA / "models" / family, ops="pallas", max_num_seqs=4, max_num_batched_tokens=64, page_size=8,
              skip_tokenizer_init=True, progress=False)
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist(), f"{family} prompt {i}"
    if family == "mistral_swa":
        assert llm.engine.scheduler.num_freed_pages > 0
