"""The Pallas GEMV in interpret mode (CPU) against ops.reference.linear.

Shapes include `out` and `in` that are not multiples of the blocks, so every masked path runs:
ragged rows, a ragged last `in` tile, split-K shares that overrun `in`, and the fori_loop path.
Tolerances (relative Frobenius error against a float32 product of the same inputs):
float32 1e-5; bfloat16 1e-2 (the output is rounded to bf16, ~2^-9 relative per element, and the
reference's own bf16 rounding differs from ours by up to one ulp).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxinfer.ops import reference
from jaxinfer.pallas import gemv as G

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

# (T, out, in, config): block_out, block_in, split_k, unroll
CASES = [
    (1, 100, 72, G.GemvConfig(block_out=4, block_in=32)),
    (3, 100, 72, G.GemvConfig(block_out=16, block_in=16, unroll=False)),
    (8, 100, 72, G.GemvConfig(block_out=8, block_in=64, split_k=2)),
    (1, 256, 200, G.GemvConfig(block_out=2, block_in=64, split_k=3)),
    (3, 256, 200, G.GemvConfig(block_out=8, block_in=128, unroll=False)),
    (8, 256, 200, G.GemvConfig(block_out=1, block_in=256)),
    (1, 256, 256, G.GemvConfig(block_out=4, block_in=64, split_k=2, unroll=False)),
    (5, 64, 512, G.GemvConfig(block_out=16, block_in=128)),
]


def _inputs(seed, T, n_out, n_in, dtype, bias):
    kx, kw, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (T, n_in), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (n_out, n_in), jnp.float32) / np.sqrt(n_in)).astype(dtype)
    b = jax.random.normal(kb, (n_out,), jnp.float32).astype(dtype) if bias else None
    return x, w, b


def _ref32(x, w, b):
    up = lambda a: None if a is None else a.astype(jnp.float32)
    return reference.linear(up(x), up(w), up(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gemv_matches_reference(case, dtype):
    T, n_out, n_in, cfg = CASES[case]
    bias = (case + (dtype == jnp.bfloat16)) % 2 == 1  # each case runs with and without a bias
    seed = 1000 * case + 10 * bias + (dtype == jnp.bfloat16)
    x, w, b = _inputs(seed, T, n_out, n_in, dtype, bias)
    y = G.gemv(x, w, b, block_out=cfg.block_out, block_in=cfg.block_in, num_warps=cfg.num_warps,
               num_stages=cfg.num_stages, split_k=cfg.split_k, unroll=cfg.unroll, interpret=True)
    assert y.shape == (T, n_out) and y.dtype == x.dtype
    assert rel_err(y, _ref32(x, w, b)) < TOL[dtype]
    if dtype == jnp.bfloat16:  # and against the reference twin itself, in the same dtype
        assert rel_err(y, reference.linear(x, w, b).astype(jnp.float32)) < TOL[dtype]


@pytest.mark.parametrize("T", [1, 3, 8])
def test_linear_wrapper(T):
    x, w, b = _inputs(7 + T, T, 100, 72, jnp.float32, True)
    y = G.linear(x, w, b, max_t=8, interpret=True)
    assert y.shape == (T, 100) and y.dtype == jnp.float32
    assert rel_err(y, _ref32(x, w, b)) < TOL[jnp.float32]


def test_linear_falls_back_above_max_t():
    for T, max_t in [(G.MAX_T + 1, G.MAX_T), (G.KERNEL_MAX_T + 1, 10**6)]:
        x, w, _ = _inputs(3, T, 32, 48, jnp.float32, False)
        np.testing.assert_array_equal(np.asarray(G.linear(x, w, max_t=max_t)),
                                      np.asarray(reference.linear(x, w)))


def test_choose_config_is_valid():
    for T in (1, 2, 4, 8, 16):
        for n_out, n_in in [(6144, 2560), (2560, 9728), (151936, 2560), (100, 72)]:
            for dtype in (jnp.bfloat16, jnp.float32):
                cfg = G.choose_config(T, n_out, n_in, dtype)
                assert G.is_pow2(cfg.block_out) and G.is_pow2(cfg.block_in)
                assert cfg.num_warps in (1, 2, 4, 8) and cfg.split_k >= 1
                lanes = 32 * cfg.num_warps
                assert T * cfg.block_out * cfg.block_in <= 64 * lanes or cfg.block_out == 1


def test_rejects_bad_blocks():
    x, w, _ = _inputs(0, 1, 16, 16, jnp.float32, False)
    with pytest.raises(ValueError):
        G.gemv(x, w, block_out=3, block_in=16, interpret=True)
