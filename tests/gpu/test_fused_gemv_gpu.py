"""The Pallas GEMV on the GPU at real decode shapes (Qwen3-4B, Llama-3-8B), against a float32 product.

Runs only where JAX sees a GPU:
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 -m pytest -q -o addopts= -n 4 \
        tests/gpu/test_gemv_gpu.py
(50 cases; about 85 s with -n 4 on the H200, so give it two minutes.)
Every distinct config of the measured table (gemv._TABLE) runs at every shape (T=1), and `linear`
forced onto the kernel (max_t) with the config it chooses at T = 3 with a bias and T = 8 without. Weights are random bf16 per shape,
x fresh per case. Tolerance: relative Frobenius error 1e-2 in bf16 (output rounding alone is
~1e-3), 1e-5 in f32.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas import gemv as G

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

SHAPES = [(6144, 2560), (19456, 2560), (2560, 9728), (2560, 4096), (4096, 4096), (28672, 4096),
          (4096, 14336), (151936, 2560)]
SHAPE_IDS = [f"{o}x{i}" for o, i in SHAPES]
TABLE_CONFIGS = sorted(set(G._TABLE.values()), key=lambda c: c.astuple())


@functools.lru_cache(maxsize=1)
def _weights(n_out, n_in):
    k = jax.random.PRNGKey(n_out * 7 + n_in)
    return jax.random.normal(k, (n_out, n_in), jnp.bfloat16) * jnp.bfloat16(1 / np.sqrt(n_in))


def _inputs(seed, T, n_out, n_in, dtype, bias):
    kx, kw, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (T, n_in), jnp.float32).astype(dtype)
    if dtype == jnp.bfloat16:
        w = _weights(n_out, n_in)
    else:
        w = (jax.random.normal(kw, (n_out, n_in), jnp.float32) / np.sqrt(n_in)).astype(dtype)
    b = jax.random.normal(kb, (n_out,), jnp.float32).astype(dtype) if bias else None
    return x, w, b


def _check(y, x, w, b, tol):
    with jax.default_matmul_precision("highest"):
        f32 = jnp.float32
        ref = jnp.dot(x.astype(f32), w.astype(f32).T)
        if b is not None:
            ref = ref + b.astype(f32)
    y = np.asarray(y.astype(jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(y))
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < tol, f"relative error {err:.3e}"


@pytest.mark.parametrize("cfg", TABLE_CONFIGS,
                         ids=[f"{c.block_out}-{c.block_in}-w{c.num_warps}-s{c.num_stages}-"
                              f"k{c.split_k}-u{int(c.unroll)}" for c in TABLE_CONFIGS])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_table_config(shape, cfg):
    n_out, n_in = shape
    x, w, _ = _inputs(hash((shape, cfg.astuple())) % 2**31, 1, n_out, n_in, jnp.bfloat16, False)
    y = G.gemv(x, w, **dataclasses.asdict(cfg))
    _check(y, x, w, None, 1e-2)


@pytest.mark.parametrize("T,bias", [(3, True), (8, False)])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_linear(shape, T, bias):
    n_out, n_in = shape
    x, w, b = _inputs(17 * T + n_out + n_in, T, n_out, n_in, jnp.bfloat16, bias)
    y = jax.jit(functools.partial(G.linear, max_t=T))(x, w, b)  # the kernel, not the fallback
    assert y.shape == (T, n_out) and y.dtype == jnp.bfloat16
    _check(y, x, w, b, 1e-2)


@pytest.mark.parametrize("T", [1, 4])
def test_linear_f32_ragged(T):
    x, w, b = _inputs(5, T, 1000, 1500, jnp.float32, True)
    _check(jax.jit(functools.partial(G.linear, max_t=T))(x, w, b), x, w, b, 1e-5)


@pytest.mark.parametrize("vocab,hidden", [(151936, 2560), (128256, 4096), (151936, 1024)])
def test_lm_head_float32_logits(vocab, hidden):
    """ops.pallas's lm_head at batch 1: the fused GEMV with float32 outputs at real vocabularies, against
    reference.logits (float32, HIGHEST): only the order of float32 sums differs."""
    from jaxinfer.ops import reference
    from jaxinfer.pallas.fused_gemv import block_in_for, fused_gemv

    kx, kw = jax.random.split(jax.random.PRNGKey(vocab + hidden))
    x = jax.random.normal(kx, (1, hidden), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (vocab, hidden), jnp.float32) / np.sqrt(hidden)).astype(jnp.bfloat16)
    y = fused_gemv(x, w, block_in=block_in_for(vocab, hidden, w.dtype), out_dtype=jnp.float32)
    ref = reference.logits(x, w)
    assert y.dtype == jnp.float32 and y.shape == ref.shape
    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert err < 1e-5, f"relative error {err:.3e}"
    assert int(jnp.argmax(y)) == int(jnp.argmax(ref))
