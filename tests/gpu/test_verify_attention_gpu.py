"""Speculative verify attention (pallas/verify_attention.py) on the GPU at real shapes, against
reference.verify_attention.

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_verify_attention_gpu.py
Qwen3-4B's attention (H 32, KVH 8, hd 128: tiles of Q x 4 rows), bf16, page size 16, pages in random order, fresh
random inputs; Q 4, 8, 16 rows a sequence; batch 1 and 8; contexts 1k and 8k.
- test_qwen3_4b: the table's configuration, a page table just covering the context, batch 8's rows ragged (one
  ends mid-page, one shorter than Q);
- test_wide_page_table: the engine's layout, a page table spanning 32,768 positions, and padding sequences of
  context 0 on the scratch page;
- test_table_config: every distinct configuration of tables.VERIFY_ATTENTION, forced, at its band's tile rows
  (32: Q 8; 128: Q 16 over groups of 8);
- test_float8_pages: float8 e4m3 caches (float16 products).
Tolerance: relative Frobenius error per (sequence, row) 2e-2 in bf16 (the output's own rounding is ~2e-3; the
probabilities are rounded to bf16 before p @ v here and, normalised, in the reference).
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.kv_cache import to_cache
from jaxinfer.ops import get_ops, reference
from jaxinfer.pallas import tables
from jaxinfer.pallas import verify_attention as VA

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

PS = 16
H, KVH, HD = 32, 8, 128      # Qwen3-4B
TOL = 2e-2
ref_op = jax.jit(reference.verify_attention, static_argnums=(6, 7))


def _problem(seed, B, Q, P, heads=(H, KVH), kv_dtype=jnp.bfloat16, L=2):
    h, kvh = heads
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    n_pages = B * P + 1
    shape = (L, kvh, n_pages * PS, HD)
    k = to_cache(jax.random.normal(kk, shape, jnp.bfloat16), kv_dtype)
    v = to_cache(jax.random.normal(kv, shape, jnp.bfloat16), kv_dtype)
    q = jax.random.normal(kq, (B, Q, h, HD), jnp.bfloat16)
    pages = jax.random.permutation(kp, jnp.arange(1, n_pages, dtype=jnp.int32))[: B * P].reshape(B, P)
    return q, k, v, pages


def _check(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = np.asarray(ref.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out))
    B, Q = out.shape[:2]
    err = np.linalg.norm((out - ref).reshape(B, Q, -1), axis=2) / np.linalg.norm(ref.reshape(B, Q, -1), axis=2)
    assert np.max(err) < TOL, f"relative error per (sequence, row) {err}"


def _run(q, k, v, layer, pt, lens, config=None):
    scale = HD ** -0.5
    cl = jnp.asarray(lens, jnp.int32)
    if config is None:   # the op set's path: the table's choice
        out = get_ops("pallas").verify_attention(q, k, v, jnp.int32(layer), pt, cl, PS, scale)
    else:
        out = VA.paged_verify_attention(q, k, v, jnp.int32(layer), pt, cl, PS, scale, config=config)
    _check(out, ref_op(q, k, v, jnp.int32(layer), pt, cl, PS, scale))


@pytest.mark.parametrize("ctx", [1024, 8192])
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("Q", [4, 8, 16])
def test_qwen3_4b(Q, B, ctx):
    q, k, v, pt = _problem(Q * 1000 + B * 10 + ctx, B, Q, ctx // PS)
    lens = [ctx] * B
    if B > 1:
        lens[1] = ctx - 9          # ends mid-page
        lens[2] = Q - 1            # shorter than Q: the first row sees position 0 only
        lens[3] = 333
    _run(q, k, v, 1, pt, lens)


@pytest.mark.parametrize("Q", [4, 16])
def test_wide_page_table(Q):
    B = 8
    q, k, v, pt = _problem(Q, B, Q, 32768 // PS, L=1)
    pt = pt.at[5].set(0).at[7].set(0)           # padding sequences on the scratch page
    lens = [32768, 8192, 1024, 100, 17, 0, 5000, 0]
    _run(q, k, v, 0, pt, lens)


def _table_configs():
    return sorted({(rows, c) for rows, _, _, c in tables.VERIFY_ATTENTION}, key=lambda rc: (rc[0], rc[1].astuple()))


TABLE_CONFIGS = _table_configs()


@pytest.mark.parametrize("rows,cfg", TABLE_CONFIGS,
                         ids=[f"M{r}-S{c.num_splits}-bk{c.block_k}-w{c.num_warps}-s{c.num_stages}" for r, c in TABLE_CONFIGS])
def test_table_config(rows, cfg):
    heads = (H, KVH) if rows <= 64 else (H, 4)          # 128 rows: Q 16 over groups of 8
    q, k, v, pt = _problem(rows + cfg.num_splits, 4, min(16, rows * heads[1] // H), 8192 // PS, heads=heads)
    lens = [8192, 1, 3000, 777]
    _run(q, k, v, 1, pt, lens, config=cfg)
    if cfg.num_splits > 1:
        _run(q, k, v, 1, pt, lens, config=dataclasses.replace(cfg, merge="jnp"))


@pytest.mark.parametrize("Q", [4, 16])
def test_float8_pages(Q):
    q, k, v, pt = _problem(Q + 7, 8, Q, 8192 // PS, kv_dtype=jnp.float8_e4m3fn)
    _run(q, k, v, 1, pt, [8192, 4000, 1024, 1, 16, 8000, 200, 3333])
