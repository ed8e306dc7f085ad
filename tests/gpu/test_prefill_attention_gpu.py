"""Paged prefill (flash) attention on the GPU at real shapes, against reference.paged_attention.

Runs only where JAX sees a GPU:
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 -m pytest -q -o addopts= \
        tests/gpu/test_prefill_attention_gpu.py
Shapes (H / KVH / hd): Qwen3-4B 32/8/128 (Llama-3-8B has the same attention shape), Qwen3-0.6B
16/8/128; bf16, page size 16, pages in random order, fresh random inputs, padding rows after the last
sequence (as the engine pads T to a bucket).
- test_prompt: one prompt of 128, 1,024, 8,192 tokens from position 0 (the table's config);
- test_chunked: the last chunk of a long prompt, its prefix already in pages: 2,048 tokens after 6,144
  (an 8,192 prompt in 2,048 chunks), 512 after 7,685 (prefix ending mid-page), 1 after 8,191;
- test_mixed_batch: several ragged sequences in one call, chunks and fresh prompts, lengths that are
  not multiples of any block;
- test_table_config: every configuration choose_config gives each shape at these tests' T (1 to
  8,205), forced on the mixed batch, in both schedule orders;
- test_float32: float32 operands (full-precision products, not TF32) at 16/8/128;
- test_reference_signature: the token_seq adapter on the engine's layout.
Tolerance: relative Frobenius error per sequence 2e-2 in bf16 (the output's own rounding is ~2e-3;
the probabilities are rounded to bf16 before p @ v here and, normalised, in the reference), 1e-4 in f32.
Padding rows must be finite.
"""

import dataclasses
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_pallas_prefill_attention import _problem as cpu_problem

from jaxinfer.ops import reference
from jaxinfer.pallas import prefill_attention as PA

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

PS = 16
SHAPES = {"qwen3-4b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}
TOL = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float32): 1e-4}
ref_op = jax.jit(reference.paged_attention, static_argnums=(7, 8))
MIXED = [(0, 1000), (5000, 512), (37, 1), (300, 77), (0, 129), (4095, 300)]


def _problem(seed, H, KVH, hd, seqs, dtype=jnp.bfloat16, pad=13, L=2, extra_pages=0):
    """The CPU tests' problem (tests/test_pallas_prefill_attention.py) at page size PS, with the
    query starts as a list for the per-sequence check."""
    *arrays, _ = cpu_problem(seed, H, KVH, hd, PS, seqs, dtype, pad=pad, extra_pages=extra_pages, L=L)
    return (*arrays, np.asarray(arrays[4]).tolist())


def _check(out, ref, qs, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = np.asarray(ref.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "non-finite output (padding rows included)"
    errs = [np.linalg.norm(out[a:b] - ref[a:b]) / np.linalg.norm(ref[a:b]) for a, b in itertools.pairwise(qs)]
    assert max(errs) < TOL[jnp.dtype(dtype)], f"relative error per sequence {errs}"


def _run(problem, layer=1, config=None):
    q, k, v, pt, qs, ts, pos, rows = problem
    scale = q.shape[-1] ** -0.5
    out = PA.paged_prefill_attention(q, k, v, jnp.int32(layer), pt, qs, pos, PS, scale, config=config)
    ref = ref_op(q, k, v, jnp.int32(layer), pt, ts, pos, PS, scale)
    _check(out, ref, rows, q.dtype)


@pytest.mark.parametrize("n", [128, 1024, 8192])
@pytest.mark.parametrize("model", list(SHAPES))
def test_prompt(model, n):
    H, KVH, hd = SHAPES[model]
    _run(_problem(n + H, H, KVH, hd, [(0, n)]))


@pytest.mark.parametrize("prefix,n", [(6144, 2048), (7685, 512), (8191, 1)])
def test_chunked(prefix, n):
    H, KVH, hd = SHAPES["qwen3-4b"]
    _run(_problem(prefix + n, H, KVH, hd, [(prefix, n)], L=1))


@pytest.mark.parametrize("model", list(SHAPES))
def test_mixed_batch(model):
    H, KVH, hd = SHAPES[model]
    _run(_problem(7, H, KVH, hd, MIXED, extra_pages=3), layer=0)


MIXED_T = sum(n for _, n in MIXED) + 13


def _table_configs():
    """(model, config): every configuration the table gives each shape, at the prompt lengths of these
    tests and the mixed batch's T, in both schedule orders."""
    out = set()
    for model, (H, KVH, hd) in SHAPES.items():
        for t in (1, 128, 1024, 2048 + 13, 8192 + 13, MIXED_T):
            c = PA.choose_config(t, H, KVH, hd)
            out |= {(model, c), (model, dataclasses.replace(c, order="natural"))}
    return sorted(out, key=lambda mc: (mc[0], mc[1].astuple()))


TABLE_CONFIGS = _table_configs()


@pytest.mark.parametrize("model,cfg", TABLE_CONFIGS,
                         ids=[f"{m}-bq{c.block_q}-bk{c.block_k}-h{c.heads}-w{c.num_warps}-s{c.num_stages}-{c.order}"
                              for m, c in TABLE_CONFIGS])
def test_table_config(model, cfg):
    H, KVH, hd = SHAPES[model]
    _run(_problem(3, H, KVH, hd, MIXED), config=cfg)


def test_float32():
    H, KVH, hd = SHAPES["qwen3-0.6b"]
    p = _problem(9, H, KVH, hd, [(0, 300), (1000, 77), (5, 1)], dtype=jnp.float32)
    for cfg in (PA.PrefillConfig(block_q=16, block_k=32, num_warps=4), PA.PrefillConfig(block_q=16, heads=1)):
        _run(p, config=cfg)


def test_reference_signature():
    H, KVH, hd = SHAPES["qwen3-4b"]
    q, k, v, pt, _, ts, pos, rows = _problem(21, H, KVH, hd, MIXED[:4])
    scale = hd ** -0.5
    out = PA.paged_attention(q, k, v, jnp.int32(1), pt, ts, pos, PS, scale)
    ref = ref_op(q, k, v, jnp.int32(1), pt, ts, pos, PS, scale)
    _check(out, ref, rows + [q.shape[0]], q.dtype)        # padding rows count too (rows of sequence 0)
