"""On the GPU: the grouped Mosaic GPU GEMM (hopper_gemm's row_tile_group) at Mixtral-8x7B's and Qwen3-30B-A3B's 1k
prefill shapes and their table's configs, random routings in the padded layout (pallas/expert_tiles.py), each tile
against its expert's own product (twins.hopper_gemm); then ops.pallas.moe_mlp with both products tabled against the
Triton grouped GEMM.

Run on the H200: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_grouped_hopper_gemm_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import LayerWeight, get_ops, reference, twins
from jaxinfer.pallas import expert_tiles as et
from jaxinfer.pallas import hopper_gemm, tables
from jaxinfer.pallas.hopper_gemm import HopperConfig

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")
bf16 = jnp.bfloat16

# (experts, top_k, tokens, D, I); the configs tables.HOPPER_GROUPED_GEMM gives their 1k prefill
SIZES = {"mixtral-8x7b": (8, 2, 1024, 4096, 14336), "qwen3-30b-a3b": (128, 8, 1024, 2048, 768)}


def _shape(name: str) -> tuple[int, int, int, int, int, HopperConfig, HopperConfig]:
    E, top_k, T, D, I = SIZES[name]
    up = hopper_gemm.grouped_table_config(T * top_k, E, 2 * I, D, "swiglu")
    down = hopper_gemm.grouped_table_config(T * top_k, E, D, I, "none")
    assert up is not None and down is not None
    return E, top_k, T, D, I, up, down


SHAPES = {name: _shape(name) for name in SIZES}


def _routing(key, T, top_k, E):
    """top_k distinct experts a token, skewed (some experts busy, some idle)."""
    logits = jax.random.gumbel(key, (T, E)) + 2 * jnp.log(jnp.arange(E, 0, -1.0))
    return jax.lax.top_k(logits, top_k)[1].astype(jnp.int32)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("product", ["gate_up", "down"])
def test_each_tile_is_its_experts_product(shape, product):
    E, top_k, T, D, I, cfg_up, cfg_down = SHAPES[shape]
    N, K, epilogue, cfg = (2 * I, D, "swiglu", cfg_up) if product == "gate_up" else (D, I, "none", cfg_down)
    ks = jax.random.split(jax.random.PRNGKey(E + N), 3)
    tiles = et.expert_tiles(*reference.sort_by_expert(_routing(ks[0], T, top_k, E), E), hopper_gemm.cta_tile(cfg)[0])
    x = et.gather_rows(jax.random.normal(ks[1], (T, K), jnp.float32).astype(bf16), tiles, top_k)
    w = (jax.random.normal(ks[2], (E, N, K), jnp.float32) / np.sqrt(K)).astype(bf16)
    y = np.asarray(hopper_gemm.hopper_gemm(x, w, epilogue=epilogue, row_tile_group=tiles.tile_expert, config=cfg),
                   np.float32)
    cta_m = hopper_gemm.cta_tile(cfg)[0]
    te = np.asarray(tiles.tile_expert)
    assert (te >= 0).sum() >= E // 2
    for i in np.flatnonzero(te >= 0):
        rows = slice(i * cta_m, (i + 1) * cta_m)
        want = np.asarray(twins.hopper_gemm(x[rows], w[te[i]], None, epilogue), np.float32)
        np.testing.assert_allclose(y[rows], want, rtol=2 ** -6, atol=2 ** -6)
        assert np.mean(y[rows] == want) > 0.99


@pytest.mark.parametrize("shape", list(SHAPES))
def test_moe_mlp_on_the_grouped_kernel_matches_the_triton_grouped_gemm(shape, monkeypatch):
    E, top_k, T, D, I, cfg_up, cfg_down = SHAPES[shape]
    ks = jax.random.split(jax.random.PRNGKey(E), 4)
    x = jax.random.normal(ks[0], (T, D), jnp.float32).astype(bf16)
    router = LayerWeight((jax.random.normal(ks[1], (1, E, D)) / np.sqrt(D)).astype(bf16), jnp.int32(0))
    gu = LayerWeight((jax.random.normal(ks[2], (1, E, 2 * I, D)) / np.sqrt(D)).astype(bf16), jnp.int32(0))
    dn = LayerWeight((jax.random.normal(ks[3], (1, E, D, I)) / np.sqrt(I)).astype(bf16), jnp.int32(0))
    ops = get_ops("pallas")
    monkeypatch.setattr(tables, "HOPPER_GROUPED_GEMM", {})
    triton = np.asarray(jax.jit(lambda x: ops.moe_mlp(x, router, gu, dn, top_k, True))(x), np.float32)
    A = T * top_k
    monkeypatch.setattr(tables, "HOPPER_GROUPED_GEMM", {(E, 2 * I, D, "swiglu"): ((A, A, cfg_up),),
                                                       (E, D, I, "none"): ((A, A, cfg_down),)})
    jax.clear_caches()
    got = np.asarray(jax.jit(lambda x: ops.moe_mlp(x, router, gu, dn, top_k, True))(x), np.float32)
    np.testing.assert_allclose(got, triton, rtol=2 ** -5, atol=2 ** -6)
    assert np.mean(got == triton) > 0.9
