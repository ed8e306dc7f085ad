"""The fused norm/RoPE/KV-write kernel (interpret mode) against ops.reference.qkv_rope_write."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import LayerWeight, reference
from jaxinfer.pallas.rope_kv_write import qkv_rope_write

TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T, H, K, hd, norm, rope", [(1, 8, 4, 16, True, True), (3, 4, 2, 8, False, True),
                                                     (5, 16, 2, 64, True, True), (2, 4, 4, 16, False, False),
                                                     (19, 4, 2, 16, True, True), (16, 8, 2, 16, True, False),
                                                     (9, 4, 2, 24, True, True)])
@pytest.mark.parametrize("norm_stack, with_kv", [("stacked", False), ("one-layer", True)])
@pytest.mark.parametrize("tiled", [8, 16], ids=["tiles-8", "tiles-16"])
def test_matches_reference(T, H, K, hd, norm, rope, dtype, norm_stack, with_kv, tiled):
    """Token counts around the 8-token tiles; norms from the cache's layer of a stack, or from a
    one-layer stack (per-layer parameters) read at index 0 while the cache is written at `layer`;
    with_kv: the k and v written returned too (a fresh prompt's attention takes them); tiled: a program's
    tokens as [tiled, hd/2] tiles (tables.ROPE_KV_WRITE_TILE); hd 24: halves of 12 padded to 16 masked columns. Tiles of
    16 must equal tiles of 8 bit for bit (a token's arithmetic does not depend on the tile it rides in)."""
    L, layer, slots = 3, 2, 64
    ks = jax.random.split(jax.random.PRNGKey(T * 100 + H + hd + norm), 8)
    qkv = jax.random.normal(ks[0], (T, (H + 2 * K) * hd), jnp.float32).astype(dtype)
    kc = jax.random.normal(ks[1], (L, K, slots, hd), jnp.float32).astype(dtype)
    vc = jax.random.normal(ks[2], (L, K, slots, hd), jnp.float32).astype(dtype)
    qn = (1 + 0.2 * jax.random.normal(ks[3], (L, hd))).astype(dtype) if norm else None
    kn = (1 + 0.2 * jax.random.normal(ks[4], (L, hd))).astype(dtype) if norm else None
    positions = jax.random.randint(ks[5], (T,), 0, 500)
    inv_freq = 1.0 / (10000 ** (jnp.arange(0, hd, 2) / hd))
    cos_sin = reference.rope_cos_sin(positions, inv_freq, dtype) if rope else None
    slot_mapping = jax.random.permutation(ks[6], slots)[:T].astype(jnp.int32)
    norm_layer = layer
    if norm and norm_stack == "one-layer":
        qn, kn, norm_layer = qn[layer][None], kn[layer][None], 0
    lw = (lambda a: None if a is None else LayerWeight(a, jnp.int32(norm_layer)))
    ref = reference.qkv_rope_write(qkv, cos_sin, lw(qn), lw(kn), 1e-6, kc, vc, jnp.int32(layer), slot_mapping, H, K,
                                   with_kv=with_kv)
    cos, sin = cos_sin if rope else (None, None)
    ours = qkv_rope_write(qkv, cos, sin, qn, kn, kc + 0, vc + 0, layer, slot_mapping, num_heads=H, num_kv_heads=K,
                          eps=1e-6, interpret=True, norm_layer=norm_layer, with_kv=with_kv, tiled=tiled)
    assert len(ours) == len(ref) == 3 + 2 * with_kv
    if tiled != 8:
        eights = qkv_rope_write(qkv, cos, sin, qn, kn, kc + 0, vc + 0, layer, slot_mapping, num_heads=H,
                                num_kv_heads=K, eps=1e-6, interpret=True, norm_layer=norm_layer, with_kv=with_kv,
                                tiled=8)
        for a, b in zip(ours, eights):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    def close(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape
        assert np.linalg.norm(a - b) <= TOL[dtype] * np.linalg.norm(b)

    close(ours[0], ref[0])
    written = np.zeros((L, K, slots), bool)
    written[layer, :, np.asarray(slot_mapping)] = True
    for a, b in zip(ours[3:], ref[3:]):   # with_kv: the k and v written, as computed
        close(a, b)
    for a, b in zip(ours[1:3], ref[1:3]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        close(a[written], b[written])                 # the new rows
        np.testing.assert_array_equal(a[~written], b[~written])  # nothing else touched


@pytest.mark.parametrize("tiled", [12, 0])
def test_tiles_are_a_power_of_two(tiled):
    qkv, cache = jnp.zeros((4, 8 * 16)), jnp.zeros((1, 2, 32, 16))
    with pytest.raises(ValueError, match="power of two"):
        qkv_rope_write(qkv, None, None, None, None, cache, cache + 0, 0, jnp.arange(4), num_heads=4, num_kv_heads=2,
                       interpret=True, tiled=tiled)
