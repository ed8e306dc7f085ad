"""The Mosaic GPU flash attention for a fresh prompt (pallas/hopper_attention.py) in Mosaic GPU's interpret mode on
the CPU, against the reference op (XLA's causal attention in float32) at several shapes with fresh random
inputs; its shape checks; its configs through the lowering for CUDA (no GPU needed); and the pallas op taking it
where its table has the prompt's length."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import get_ops, reference
from jaxinfer.pallas import hopper_attention, tables
from jaxinfer.pallas.hopper_attention import FlashConfig


def _inputs(seed, T, H, KVH, hd, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (T, H, hd), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (T, KVH, hd), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (T, KVH, hd), jnp.float32).astype(dtype)
    return q, k, v


def _close(out, q, k, v, scale):
    """Against the float32 reference: the output's own rounding plus P rounded to 16 bits before P V (as cuDNN
    and every flash attention round it): a few bf16 steps at most, far under a masking or indexing error (~1)."""
    ref = np.asarray(reference.fresh_prompt_attention(*(a.astype(jnp.float32) for a in (q, k, v)), scale))
    out = np.asarray(out, np.float32)
    assert out.shape == ref.shape
    err = np.abs(out - ref)
    assert err.max() < 3e-2, err.max()
    assert err.mean() < 3e-3, err.mean()


@pytest.mark.parametrize("T, H, KVH, hd, dtype, config", [
    (128, 2, 1, 64, jnp.bfloat16, FlashConfig()),            # one row tile: the diagonal block only
    (384, 4, 2, 64, jnp.bfloat16, FlashConfig()),            # 3 tiles, GQA 2: 12 items on 3 CTAs, 4 rounds
    (384, 2, 1, 64, jnp.bfloat16, FlashConfig(persistent=False)),   # one CTA an item
    (384, 4, 2, 128, jnp.bfloat16, FlashConfig(stages=1, q_buffers=2)),   # the next item's Q loaded early
    (256, 3, 3, 128, jnp.float16, FlashConfig(stages=1)),    # no GQA, two swizzle atoms a row, a one-deep ring
                                                             # (ping-pong deadlocked it while the memory warpgroup
                                                             # waited for V's release before loading K)
    (256, 6, 2, 64, jnp.bfloat16, FlashConfig(stages=3)),    # GQA 3 (not a power of two)
    (384, 2, 2, 64, jnp.bfloat16, FlashConfig(pingpong=False)),   # the warpgroups not taking turns
    (256, 2, 1, 64, jnp.bfloat16, FlashConfig(stages=1, pingpong=False)),
])
def test_matches_reference_in_interpret_mode(T, H, KVH, hd, dtype, config):
    q, k, v = _inputs(T + H + hd, T, H, KVH, hd, dtype)
    scale = hd ** -0.5
    out = hopper_attention.fresh_prompt_flash(q, k, v, scale, config=config, ctas=3, interpret=True)
    assert out.dtype == dtype
    _close(out, q, k, v, scale)


def test_rows_do_not_see_later_keys():
    """Causal: changing the keys and values of the second half leaves the first half's rows as they were."""
    q, k, v = _inputs(3, 256, 2, 1, 64)
    a = hopper_attention.fresh_prompt_flash(q, k, v, 0.125, interpret=True)
    b = hopper_attention.fresh_prompt_flash(q, k.at[128:].set(7.0), v.at[128:].set(-3.0), 0.125, interpret=True)
    np.testing.assert_array_equal(np.asarray(a[:128], np.float32), np.asarray(b[:128], np.float32))
    assert not np.array_equal(np.asarray(a[128:], np.float32), np.asarray(b[128:], np.float32))


def test_shapes_it_does_not_take_are_refused_and_say_why():
    q, k, _ = _inputs(0, 256, 4, 2, 64)
    assert hopper_attention.supported(q, k)
    for qq, kk in [(q[:200], k[:200]),                                   # not whole 128-row tiles
                   (q[..., :48], k[..., :48]),                           # head dim not a multiple of 64
                   (q[:, :3], k),                                        # 3 query heads over 2 KV heads
                   (q.astype(jnp.float32), k.astype(jnp.float32)),       # 16-bit only
                   (jnp.zeros((256, 4, 256), q.dtype), jnp.zeros((256, 2, 256), q.dtype))]:   # hd 256: too big
        assert not hopper_attention.supported(qq, kk)
        with pytest.raises(ValueError, match="do not tile"):
            hopper_attention.fresh_prompt_flash(qq, kk, kk, 0.125, interpret=True)


def test_table_config_covers_only_measured_lengths(monkeypatch):
    monkeypatch.setattr(tables, "FRESH_PROMPT_FLASH", [(512, 1024, FlashConfig())])
    q, k, _ = _inputs(0, 1024, 4, 2, 64)
    assert hopper_attention.table_config(q, k) == FlashConfig()
    assert hopper_attention.table_config(q[:256], k[:256]) is None                  # shorter than measured
    assert hopper_attention.table_config(q[..., :32], k[..., :32]) is None          # in range, not supported


def test_pallas_op_takes_the_kernel_where_the_table_has_the_length(monkeypatch):
    """The fresh prompt's attention op runs the kernel for a length in the table (the reference's outputs), and
    XLA's attention (the reference) outside it."""
    calls = []
    real = hopper_attention.fresh_prompt_flash
    monkeypatch.setattr(hopper_attention, "fresh_prompt_flash",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    monkeypatch.setattr(tables, "FRESH_PROMPT_FLASH", [(256, 256, FlashConfig())])
    ops = get_ops("pallas-interpret")
    q, k, v = _inputs(5, 256, 4, 2, 64)
    _close(ops.fresh_prompt_attention(q, k, v, 0.125), q, k, v, 0.125)
    assert calls == [256]
    out = ops.fresh_prompt_attention(q[:128], k[:128], v[:128], 0.125)
    assert calls == [256]
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(reference.fresh_prompt_attention(q[:128], k[:128], v[:128], 0.125),
                                             np.float32))


def test_the_kernel_needs_a_hopper_gpu(monkeypatch):
    """Off a Hopper GPU (here: the CPU) the op keeps cuDNN/XLA even at a length in the table."""
    monkeypatch.setattr(tables, "FRESH_PROMPT_FLASH", [(256, 256, FlashConfig())])
    monkeypatch.setattr(hopper_attention, "fresh_prompt_flash", lambda *a, **kw: pytest.fail("kernel called"))
    q, k, v = _inputs(6, 256, 4, 2, 64)
    get_ops("pallas").fresh_prompt_attention(q, k, v, 0.125)


@pytest.mark.parametrize("T, H, KVH, config", [(1024, 32, 8, FlashConfig()), (8192, 32, 8, FlashConfig()),
                                               (1024, 32, 8, FlashConfig(stages=1)),
                                               (1024, 32, 8, FlashConfig(pingpong=False)),
                                               (1024, 32, 8, FlashConfig(persistent=False)),
                                               (1024, 32, 8, FlashConfig(stages=1, q_buffers=2)),
                                               (2048, 16, 8, FlashConfig())])
def test_configs_lower_for_the_gpu(T, H, KVH, config):
    """Qwen3-4B's / Llama-3-8B's (32/8) and Qwen3-0.6B's (16/8) heads at 128 go through Mosaic GPU's lowering for
    CUDA here, without a GPU: layouts and the 227 KB of shared memory checked before device time is spent."""
    q, k = jax.ShapeDtypeStruct((T, H, 128), jnp.bfloat16), jax.ShapeDtypeStruct((T, KVH, 128), jnp.bfloat16)
    f = functools.partial(hopper_attention.fresh_prompt_flash, scale=128 ** -0.5, config=config, ctas=132)
    assert "mosaic_gpu" in jax.jit(f).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()


def test_shared_memory_estimate_matches_the_lowering():
    """smem_bytes: the 2-deep ring at hd 128 fits (224 KB, lowered above), the 3-deep does not (its lowering failed
    with "exceeds available shared memory" before supported() checked the estimate)."""
    assert hopper_attention.smem_bytes(128, FlashConfig()) <= hopper_attention.SMEM_BYTES
    assert hopper_attention.smem_bytes(128, FlashConfig(stages=3)) > hopper_attention.SMEM_BYTES
    assert hopper_attention.smem_bytes(128, FlashConfig(stages=1, q_buffers=2)) <= hopper_attention.SMEM_BYTES
    assert hopper_attention.smem_bytes(128, FlashConfig(stages=2, q_buffers=2)) > hopper_attention.SMEM_BYTES


def test_a_ring_over_the_shared_memory_is_refused_before_lowering():
    """A 3-deep ring at hd 128 would exceed the 227 KB (Mosaic GPU's lowering says "exceeds available shared
    memory"): supported() refuses it first, so the op keeps cuDNN rather than failing to compile."""
    q, k = jax.ShapeDtypeStruct((1024, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 8, 128), jnp.bfloat16)
    assert not hopper_attention.supported(q, k, FlashConfig(stages=3))
    f = functools.partial(hopper_attention.fresh_prompt_flash, scale=0.1, config=FlashConfig(stages=3), ctas=132)
    with pytest.raises(ValueError, match="do not tile"):
        jax.jit(f).trace(q, k, k)
