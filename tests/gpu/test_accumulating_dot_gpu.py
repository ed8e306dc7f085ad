"""tables.DOT_INTO_ACCUMULATOR on the GPU (pallas/accumulating_dot.py): the grouped GEMM (Mixtral's and Qwen3-MoE's
prompt shapes), the skinny GEMM (batched decode rows) and the decode attention kernels give, with the products
accumulated inside the MMA, what they give without it, within the float32 sums' reordering: the same bf16 outputs
but for rounding flips (a bf16 unit where the float32 sum sits on a boundary), at most a few in a thousand.

Runs only where JAX sees a GPU (gpu_round_next.sh 8 runs it):
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_accumulating_dot_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas import tables
from jaxinfer.pallas.grouped_gemm import choose_config, grouped_gemm, sorted_items
from jaxinfer.pallas.skinny_gemm import skinny_gemm

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _off_on(monkeypatch, fn):
    outs = []
    for on in (False, True):
        monkeypatch.setattr(tables, "DOT_INTO_ACCUMULATOR", on)
        jax.clear_caches()
        outs.append(np.asarray(jax.block_until_ready(fn()).astype(jnp.float32), np.float64))
    return outs


def _close(off, on):
    assert np.all(np.isfinite(on))
    flips = np.mean(off != on)
    rel = np.linalg.norm(on - off) / np.linalg.norm(off)
    assert flips < 5e-3 and rel < 2e-3, (flips, rel)


@pytest.mark.parametrize("shape", [("mixtral", 8, 4096, 14336, 2048), ("qwen3-moe", 128, 2048, 768, 8192)],
                         ids=lambda s: s[0])
@pytest.mark.parametrize("epilogue", ["swiglu", "none"])
def test_grouped_gemm_with_and_without(monkeypatch, shape, epilogue):
    _, E, D, I, M = shape
    N, K = (2 * I, D) if epilogue == "swiglu" else (D, I)
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(E + K), 3)
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    w = jax.random.normal(kw, (1, E, N, K), jnp.bfloat16) * jnp.bfloat16(K ** -0.5)
    sizes = jnp.bincount(jax.random.randint(kg, (M,), 0, E), length=E).astype(jnp.int32)
    items = sorted_items(sizes, M, choose_config(M / E, N, K, epilogue).block_m)
    _close(*_off_on(monkeypatch, lambda: grouped_gemm(x, w, items, epilogue=epilogue)))


@pytest.mark.parametrize("rows", [8, 64])
def test_skinny_gemm_with_and_without(monkeypatch, rows):
    kx, kw = jax.random.split(jax.random.PRNGKey(rows))
    x = jax.random.normal(kx, (rows, 2560), jnp.bfloat16)
    w = jax.random.normal(kw, (1, 19456, 2560), jnp.bfloat16) * jnp.bfloat16(2560 ** -0.5)
    _close(*_off_on(monkeypatch, lambda: skinny_gemm(x, w, 0, epilogue="swiglu")))


@pytest.mark.parametrize("batch,context", [(1, 4096), (8, 1024)])
def test_decode_attention_with_and_without(monkeypatch, batch, context):
    H, KVH, hd, page = 32, 8, 128, 16
    pages = context // page
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(batch), 3)
    q = jax.random.normal(kq, (batch, H, hd), jnp.bfloat16)
    k = jax.random.normal(kk, (1, KVH, batch * context, hd), jnp.bfloat16)
    v = jax.random.normal(kv, (1, KVH, batch * context, hd), jnp.bfloat16)
    table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    lens = jnp.full((batch,), context, jnp.int32)
    _close(*_off_on(monkeypatch, lambda: DA.paged_decode_attention(q, k, v, 0, table, lens, page, hd ** -0.5)))
