"""Split-sequence paged decode attention on the GPU at real shapes, against reference.paged_decode_attention.

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_decode_attention_gpu.py
Shapes (H / KVH / hd): Qwen3-4B 32/8/128, Llama-3-8B 32/8/128, Qwen3-0.6B 16/8/128; page size 16;
contexts 1, 100, 1024, 8192, 32768; batch 1, 8, 64; pages in random order; fresh random bf16 inputs.
- test_wide_page_table: the engine's layout, a page table spanning 32,768 positions whatever the
  contexts, the rows of one batch at different lengths (the table's choice for that span);
- test_tight_page_table: the page table just covers the context, so every row of the table is chosen;
- test_table_config: every distinct configuration of the table (and the fallback heuristic's), forced.
Tolerance: relative Frobenius error per sequence 2e-2 in bf16 (the output's own rounding is ~2e-3;
the probabilities are rounded to bf16 before p @ v here and, normalised, in the reference), 1e-4 in f32.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas import tables

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

PS = 16
SHAPES = {"qwen3-4b": (32, 8, 128), "llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}
CONTEXTS = [1, 100, 1024, 8192, 32768]
BATCHES = [1, 8, 64]
TOL = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float32): 1e-4}
ref_op = jax.jit(reference.paged_decode_attention, static_argnums=(6, 7))


def _table_configs():
    cfgs = {cfg for _, _, cfg in tables.DECODE_ATTENTION}
    for B in BATCHES:
        for span in CONTEXTS:
            cfgs.add(DA.choose_config(B, 8, span))
    return sorted(cfgs, key=lambda c: c.astuple())


TABLE_CONFIGS = _table_configs()


def _problem(seed, B, H, KVH, hd, P, dtype=jnp.bfloat16, L=2):
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    n_pages = B * P + 1
    shape = (L, KVH, n_pages * PS, hd)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv, shape, dtype)
    q = jax.random.normal(kq, (B, H, hd), dtype)
    pages = jax.random.permutation(kp, jnp.arange(1, n_pages, dtype=jnp.int32))[: B * P].reshape(B, P)
    return q, k, v, pages


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = np.asarray(ref.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out))
    err = np.linalg.norm((out - ref).reshape(len(out), -1), axis=1) / np.linalg.norm(
        ref.reshape(len(ref), -1), axis=1)
    assert np.max(err) < TOL[jnp.dtype(dtype)], f"relative error per sequence {err}"


def _run(q, k, v, layer, pt, lens, config=None):
    scale = q.shape[-1] ** -0.5
    cl = jnp.asarray(lens, jnp.int32)
    out = DA.paged_decode_attention(q, k, v, jnp.int32(layer), pt, cl, PS, scale, config=config)
    ref = ref_op(q, k, v, jnp.int32(layer), pt, cl, PS, scale)
    _check(out, ref, q.dtype)


@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("model", list(SHAPES))
def test_wide_page_table(model, B):
    H, KVH, hd = SHAPES[model]
    P = 32768 // PS
    q, k, v, pt = _problem(B * 7 + H, B, H, KVH, hd, P, L=1 if B == 64 else 2)
    layer = 0 if B == 64 else 1
    if B == 1:
        for ctx in CONTEXTS:
            _run(q, k, v, layer, pt, [ctx])
    else:
        lens = [CONTEXTS[i % len(CONTEXTS)] - (i // len(CONTEXTS)) % 3 for i in range(B)]
        _run(q, k, v, layer, pt, [max(1, n) for n in lens])


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("model", ["qwen3-4b", "qwen3-0.6b"])
def test_tight_page_table(model, B, ctx):
    H, KVH, hd = SHAPES[model]
    P = -(-ctx // PS)
    q, k, v, pt = _problem(ctx + B, B, H, KVH, hd, P, L=1 if B * ctx > 2**18 else 2)
    lens = [ctx] * B
    if B > 1 and ctx > 9:
        lens[-1] = ctx - 9                    # one row ending mid-page
    _run(q, k, v, 0, pt, lens)


@pytest.mark.parametrize("cfg", TABLE_CONFIGS,
                         ids=[f"S{c.num_splits}-bk{c.block_k}-w{c.num_warps}-s{c.num_stages}-{c.merge}"
                              for c in TABLE_CONFIGS])
def test_table_config(cfg):
    H, KVH, hd = SHAPES["qwen3-4b"]
    q, k, v, pt = _problem(3, 4, H, KVH, hd, 8192 // PS)
    _run(q, k, v, 1, pt, [8192, 1, 3000, 777], config=cfg)
    _run(q, k, v, 1, pt, [8192, 1, 3000, 777], config=dataclasses.replace(cfg, merge="jnp"))


def test_float32():
    H, KVH, hd = SHAPES["qwen3-0.6b"]
    q, k, v, pt = _problem(9, 3, H, KVH, hd, 64, dtype=jnp.float32)
    for S in (1, 8):
        _run(q, k, v, 1, pt, [1024, 17, 300], config=DA.SplitConfig(num_splits=S))
