"""The decode attention kernels on an INT8 KV cache (pallas/decode_attention.py, pallas/decode_attention_rope.py,
values and scales as operands) on the GPU at Qwen3-4B's shapes, against the reference ops on the same
ops.quantized_cache.QuantizedCache.

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_kv_cache_int8_gpu.py
Shapes: 32 / 8 heads, hd 128, q/k norms, RoPE; page size 16; batch 1 at 1,024 and 32,768 positions, batch 8 and 64
with rows of 1, 100, 1,024 and 8,192 positions in a page table spanning 8,192; the int8 conversions ("cvt", "bits", "prmt");
fresh random bf16 vectors of random magnitudes (1e-3..10), quantized; the configuration the table picks; the verify
kernel with 4 rows a sequence (3 drafts); the prompt rows' write of 1,000 tokens. Tolerances:
the output per sequence, relative Frobenius 2e-2 (tests/gpu/test_decode_attention_gpu.py's); the new rows' values
within two steps (the kernel's norm may round k 1 ulp apart, and Triton's division is within 2 ulp), their scales
1e-2; every other row and scale untouched.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.ops.quantized_cache import QuantizedCache, quantize
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas import verify_attention as VA
from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

PS, L, H, K, HD = 16, 2, 32, 8, 128
CASES = [(1, 1024), (1, 32768), (8, 8192), (64, 8192)]   # (batch, page-table span)


def _reference(qkv, cos_sin, qn, kn, k, v, layer, slots, pt, cl, scale):
    return reference.decode_qkv_attention(qkv, cos_sin, qn[layer], kn[layer], 1e-6, k, v, layer, slots, pt, cl, PS,
                                          scale, H, K)


ref_fused = jax.jit(_reference, static_argnums=(10,))
ref_plain = jax.jit(reference.paged_decode_attention, static_argnums=(6, 7))
ref_verify = jax.jit(reference.verify_attention, static_argnums=(6, 7))


def _cache(key, shape):
    x = jax.random.normal(key, shape, jnp.bfloat16).astype(jnp.float32)
    amp = 10.0 ** jax.random.uniform(jax.random.fold_in(key, 1), shape[:-1] + (1,), minval=-3, maxval=1)
    return QuantizedCache(*jax.jit(quantize)(x * amp))


def _problem(B, span):
    rng = np.random.default_rng(B * 13 + span)
    lens = rng.choice([1, 100, 1024, span], B) if B > 1 else np.array([span])
    lens[0] = span
    P = span // PS
    n_pages = B * P + 1
    shape = (L, K, n_pages * PS, HD)
    kq, vq = _cache(jax.random.PRNGKey(B), shape), _cache(jax.random.PRNGKey(B + 1), shape)
    pages = rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32)
    return kq, vq, jnp.asarray(pages), lens


def _close(o, ro, lens, tol=2e-2):
    o, ro = np.asarray(o, np.float32), np.asarray(ro, np.float32)
    assert np.all(np.isfinite(o))
    for b in range(o.shape[0]):
        err = np.linalg.norm(o[b] - ro[b]) / np.linalg.norm(ro[b])
        assert err < tol, f"sequence {b} (context {lens[b]}): relative error {err:.2e}"


@pytest.mark.parametrize("convert", ["cvt", "bits", "prmt"])
@pytest.mark.parametrize("B, span", CASES)
def test_split_kernel(B, span, convert):
    kq, vq, pt, lens = _problem(B, span)
    q = jax.random.normal(jax.random.PRNGKey(B + 2), (B, H, HD), jnp.bfloat16)
    cl, layer, scale = jnp.asarray(lens.astype(np.int32)), jnp.int32(1), HD ** -0.5
    ro = ref_plain(q, kq, vq, layer, pt, cl, PS, scale)
    o = DA.paged_decode_attention(q, kq.values, vq.values, layer, pt, cl, PS, scale, k_scale=kq.scale,
                                  v_scale=vq.scale, int8_convert=convert)
    _close(o, ro, lens)


@pytest.mark.parametrize("convert", ["cvt", "bits", "prmt"])
@pytest.mark.parametrize("B, span", CASES)
def test_fused_kernel(B, span, convert):
    kq, vq, pt, lens = _problem(B, span)
    qkv = jax.random.normal(jax.random.PRNGKey(B + 3), (B, (H + 2 * K) * HD), jnp.bfloat16)
    pos = lens - 1
    pages = np.asarray(pt)
    slots = jnp.asarray(pages[np.arange(B), pos // PS] * PS + pos % PS, jnp.int32)
    inv_freq = 1.0 / (1e6 ** (np.arange(0, HD, 2, dtype=np.float32) / HD))
    cos_sin = reference.rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_freq), jnp.bfloat16)
    qn = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(B + 4), (L, HD), jnp.bfloat16)
    kn = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(B + 5), (L, HD), jnp.bfloat16)
    cl, layer, scale = jnp.asarray(lens.astype(np.int32)), jnp.int32(1), HD ** -0.5
    ro, rk, rv = ref_fused(qkv, cos_sin, qn, kn, kq, vq, layer, slots, pt, cl, scale)
    o, kv, vv, ks, vs = decode_attention_rope_write(
        qkv, *cos_sin, qn, kn, jnp.array(kq.values), jnp.array(vq.values), layer, slots, pt, cl, page_size=PS,
        scale=scale, num_heads=H, num_kv_heads=K, eps=1e-6, k_scale=jnp.array(kq.scale),
        v_scale=jnp.array(vq.scale), int8_convert=convert)
    # The new token's int8 values may sit two steps from the reference's (below), and where it dominates a
    # sequence's attention that moves the output by ~2/127: 3e-2 (H200: 2.3e-2 at one of 64 sequences)
    _close(o, ro, lens, tol=3e-2)
    written = np.zeros(kq.scale.shape, bool)
    written[1, :, np.asarray(slots)] = True
    for values, scales, want in ((kv, ks, rk), (vv, vs, rv)):
        a, b = np.asarray(values, np.int32), np.asarray(want.values, np.int32)
        # two steps: the kernel's norm and RoPE round k an ulp from XLA's, which moves both the amax (the scale)
        # and a value near a rounding boundary (H200: 2 at a few of the written values)
        assert np.abs(a[written] - b[written]).max() <= 2
        np.testing.assert_allclose(np.asarray(scales)[written], np.asarray(want.scale)[written], rtol=1e-2)
        np.testing.assert_array_equal(a[~written], b[~written])
        np.testing.assert_array_equal(np.asarray(scales)[~written], np.asarray(want.scale)[~written])


@pytest.mark.parametrize("B, span", CASES[:3])
def test_verify_kernel(B, span):
    kq, vq, pt, lens = _problem(B, span)
    Q = 4
    q = jax.random.normal(jax.random.PRNGKey(B + 6), (B, Q, H, HD), jnp.bfloat16)
    cl, layer, scale = jnp.asarray(np.maximum(lens, Q).astype(np.int32)), jnp.int32(1), HD ** -0.5
    ro = ref_verify(q, kq, vq, layer, pt, cl, PS, scale)
    o = VA.paged_verify_attention(q, kq.values, vq.values, layer, pt, cl, PS, scale, k_scale=kq.scale,
                                  v_scale=vq.scale)
    _close(o.reshape(B, -1), ro.reshape(B, -1), lens)


def test_prompt_rows_write():
    """pallas/rope_kv_write.py quantizing 1,000 prompt rows into the cache, against reference.qkv_rope_write."""
    from jaxinfer.ops import LayerWeight
    from jaxinfer.pallas.rope_kv_write import qkv_rope_write

    T, slots = 1000, 4096
    kq, vq = _cache(jax.random.PRNGKey(7), (L, K, slots, HD)), _cache(jax.random.PRNGKey(8), (L, K, slots, HD))
    qkv = jax.random.normal(jax.random.PRNGKey(9), (T, (H + 2 * K) * HD), jnp.bfloat16)
    qn = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(10), (L, HD), jnp.bfloat16)
    pos = jnp.arange(T)
    cos_sin = reference.rope_cos_sin(pos, 1.0 / (1e6 ** (jnp.arange(0, HD, 2) / HD)), jnp.bfloat16)
    slot_mapping = jax.random.permutation(jax.random.PRNGKey(11), slots)[:T].astype(jnp.int32)
    layer = jnp.int32(1)
    ref = jax.jit(lambda qkv, kq, vq: reference.qkv_rope_write(   # LayerWeight is no jit argument: closed over
        qkv, cos_sin, LayerWeight(qn, layer), LayerWeight(qn, layer), 1e-6, kq, vq, layer, slot_mapping, H, K))(
        qkv, kq, vq)
    q, kv, vv, ks, vs = qkv_rope_write(qkv, *cos_sin, qn, qn, jnp.array(kq.values), jnp.array(vq.values), layer,
                                       slot_mapping, num_heads=H, num_kv_heads=K, k_scale=jnp.array(kq.scale),
                                       v_scale=jnp.array(vq.scale))
    a, b = np.asarray(q, np.float32), np.asarray(ref[0], np.float32)
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)
    written = np.zeros(kq.scale.shape, bool)
    written[1, :, np.asarray(slot_mapping)] = True
    for values, scales, want in ((kv, ks, ref[1]), (vv, vs, ref[2])):
        a, b = np.asarray(values, np.int32), np.asarray(want.values, np.int32)
        assert np.abs(a[written] - b[written]).max() <= 1
        np.testing.assert_allclose(np.asarray(scales)[written], np.asarray(want.scale)[written], rtol=1e-2)
        np.testing.assert_array_equal(a[~written], b[~written])


@pytest.mark.parametrize("how", ["cvt", "bits", "prmt"])
def test_int8_to_float16_in_a_kernel_is_exact(how):
    """Each int8 -> float16 conversion the attention kernels compile (prmt: inline PTX, GPU only) gives every value."""
    from jax.experimental import pallas as pl

    from jaxinfer.pallas.decode_attention import int8_to

    def kernel(x_ref, o_ref):
        o_ref[...] = int8_to(x_ref[...], jnp.float16, how)

    x = jnp.tile(jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8), 4)
    y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float16))(x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))
