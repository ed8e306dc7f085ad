"""The grouped (mixture-of-experts) GEMM in interpret mode against the reference ops: rows sorted by expert with
empty experts, groups that straddle row tiles, columns and depths that are not multiples of the tiles, split K,
the SwiGLU epilogue, a layer of a [L, E, N, K] stack; and one item a row (the batch-1 decode schedule).

Tolerances: float32 1e-5 relative (same products, another summation order); bfloat16 1e-2 relative (outputs
round to bf16, and SwiGLU rounds silu in float32 where the reference rounds it in bf16).
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import moe_block, rel_err
from jaxinfer.ops import LayerWeight, reference
from jaxinfer.pallas import expert_tiles as et
from jaxinfer.pallas.grouped_gemm import GroupedGemmConfig, grouped_gemm, max_items, row_items, sorted_items

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# (group sizes, N, K, config): ragged everywhere with empty experts; exact tiles; split K with a ragged share;
# one expert holding every row
CASES = [
    ((5, 0, 19, 1, 0, 12), 40, 72, GroupedGemmConfig(block_m=16, block_n=16, block_k=32)),
    ((16, 32, 16, 0), 64, 128, GroupedGemmConfig(block_m=16, block_n=32, block_k=64)),
    ((3, 9, 0, 7), 48, 200, GroupedGemmConfig(block_m=16, block_n=16, block_k=32, split_k=3)),
    ((0, 0, 37), 32, 64, GroupedGemmConfig(block_m=32, block_n=32, block_k=32)),
]


def _operands(seed, sizes, N, K, dtype, L=3):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    M = sum(sizes)
    x = jax.random.normal(keys[0], (M, K), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (L, len(sizes), N, K), jnp.float32) / np.sqrt(K)).astype(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_sorted_rows_match_ragged_dot(epilogue, case, dtype):
    sizes, N, K, cfg = CASES[case]
    # (a seed of the case's own: Python's hash of strings changes from process to process)
    x, w = _operands(zlib.crc32(repr((epilogue, case, str(dtype))).encode()), sizes, N, K, dtype)
    layer = 1
    gs = jnp.asarray(sizes, jnp.int32)
    items = sorted_items(gs, x.shape[0], cfg.block_m)
    y = grouped_gemm(x, w, items, layer, epilogue=epilogue, config=cfg, interpret=True)
    ref = reference.grouped_linear(x, LayerWeight(w, jnp.int32(layer)), gs)
    if epilogue == "swiglu":
        ref = reference.swiglu(ref)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert rel_err(y, ref) <= TOL[dtype]


def test_sorted_items_cover_every_row_once():
    """Random group sizes and tile heights: every row in exactly one item, of its own group, items no taller
    than a tile; the item count within max_items."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        E, bm = int(rng.integers(1, 9)), int(rng.choice([16, 32]))
        sizes = rng.integers(0, 40, E) * (rng.random(E) < 0.7)
        M = int(sizes.sum()) + int(rng.integers(0, 5))   # rows past the groups: padding no item holds
        items = np.asarray(sorted_items(jnp.asarray(sizes), M, bm))
        assert items.shape == (max_items(M, E, bm), 3)
        owner = np.full(M, -1)
        for g, lo, hi in items:
            assert 0 <= hi - lo <= bm
            assert (owner[lo:hi] == -1).all()
            owner[lo:hi] = g
        assert (owner[:sizes.sum()] == np.repeat(np.arange(E), sizes)).all() and (owner[sizes.sum():] == -1).all()


@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_row_items_read_each_rows_expert(epilogue):
    """One item a row (a batch-1 decode step's top-k rows): row r times its expert's matrix, split K too."""
    N, K, E = 48, 96, 6
    x, w = _operands(7, (0,) * E, N, K, jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(8), (5, K), jnp.float32)
    experts = jnp.asarray([4, 0, 5, 2, 3], jnp.int32)
    for cfg in (GroupedGemmConfig(block_m=16, block_n=16, block_k=32),
                GroupedGemmConfig(block_m=16, block_n=32, block_k=32, split_k=2)):
        y = grouped_gemm(x, w, row_items(experts), 2, epilogue=epilogue, config=cfg, interpret=True)
        ref = jnp.einsum("rk,rnk->rn", x, w[2, experts], precision=jax.lax.Precision.HIGHEST)
        if epilogue == "swiglu":
            ref = reference.swiglu(ref)
        assert rel_err(y, ref) <= 1e-5


def test_bad_operands_are_one_clear_error():
    x = jnp.zeros((4, 32), jnp.float32)
    w = jnp.zeros((2, 16, 32), jnp.float32)
    items = row_items(jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="disagree on K"):
        grouped_gemm(x, jnp.zeros((2, 16, 24), jnp.float32), items, interpret=True)
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_gemm(x, w.astype(jnp.bfloat16), items, interpret=True)
    with pytest.raises(ValueError, match="bad config"):
        grouped_gemm(x, w, items, config=GroupedGemmConfig(block_m=8), interpret=True)


@pytest.mark.parametrize("T", [1, 64, 1024])
def test_lowers_to_triton_at_real_shapes(monkeypatch, T):
    """ops.pallas.moe_mlp at the Qwen3-30B-A3B shape lowers to Triton IR for an H200 (on the CPU, the GPU's
    description stubbed in as tests/test_triton_lowering.py does): what interpret mode cannot check."""
    from jax._src.pallas.triton import gpu_info

    from jaxinfer.ops import get_ops

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    E, k, D, I, L = 128, 8, 2048, 768, 48
    s = jax.ShapeDtypeStruct
    args = (s((T, D), jnp.bfloat16), s((L, E, D), jnp.bfloat16), s((L, E, 2 * I, D), jnp.bfloat16),
            s((L, E, D, I), jnp.bfloat16), s((), jnp.int32))
    ops = get_ops("pallas")

    def fn(x, router, gate_up, down, layer):
        return ops.moe_mlp(x, *(LayerWeight(w, layer) for w in (router, gate_up, down)), k, True)

    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") >= 2


def test_table_rows_share_one_schedule_for_both_products():
    """Every row of tables.GROUPED_GEMM: a valid config, and at each assignment count the gate/up's and the down's
    rows at one block_m (else table_configs gives None and the block falls back to choose_config's pair)."""
    from jaxinfer.pallas import grouped_gemm as gg, tables

    table = tables.GROUPED_GEMM
    assert table
    for (E, N, K, epilogue), rows in table.items():
        for first, last, c in rows:
            assert 0 < first <= last
            assert all(v > 0 and v & (v - 1) == 0 for v in (c.block_m, c.block_n, c.block_k)) and c.block_m >= 16
        if epilogue == "swiglu":
            assert (E, K, N // 2, "none") in table
            for a in sorted({r[0] for r in rows} | {r[1] for r in rows}):
                up, down = gg.table_configs(a, E, N, K)
                assert up.block_m == down.block_m, a


def test_moe_mlp_takes_the_table_configs_where_both_products_have_a_row(monkeypatch):
    """The pallas ops' mixture of experts on batched rows runs tables.GROUPED_GEMM's configs where both products
    have a row at that many assignments with one block_m (the reference's outputs), else choose_config's pair."""
    from jaxinfer.ops import get_ops
    from jaxinfer.ops import pallas as pallas_ops
    from jaxinfer.pallas import tables
    from jaxinfer.pallas.grouped_gemm import choose_config

    T, D, I, E, top_k = 20, 64, 64, 4, 2
    x, r, gu, dn, want, _ = moe_block(T, D, I, E, top_k, seed=5)

    configs = []
    real = pallas_ops.grouped_gemm
    monkeypatch.setattr(pallas_ops, "grouped_gemm", lambda *a, **k: configs.append(k["config"]) or real(*a, **k))
    monkeypatch.setattr(tables, "HOPPER_GROUPED_GEMM", {})
    ops = get_ops("pallas-interpret")
    up, down = GroupedGemmConfig(32, 32, 32, 4, 2), GroupedGemmConfig(32, 64, 16, 4, 3)
    monkeypatch.setattr(tables, "GROUPED_GEMM", {(E, 2 * I, D, "swiglu"): ((T * top_k, T * top_k, up),),
                                                 (E, D, I, "none"): ((T * top_k, T * top_k, down),)})
    got = np.asarray(ops.moe_mlp(x, r, gu, dn, top_k, True, residual=x), np.float32)
    assert configs == [up, down]
    np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=2 ** -5)

    rule = choose_config(T * top_k / E, 2 * I, D, "swiglu")
    for table in ({(E, 2 * I, D, "swiglu"): ((T * top_k, T * top_k, up),)},                       # no down row
                  {(E, 2 * I, D, "swiglu"): ((T * top_k, T * top_k, up),),                       # two schedules
                   (E, D, I, "none"): ((T * top_k, T * top_k, GroupedGemmConfig(16, 64, 16)),)},
                  {(E, 2 * I, D, "swiglu"): ((1, T * top_k - 1, up),),                           # another count
                   (E, D, I, "none"): ((1, T * top_k - 1, down),)}):
        monkeypatch.setattr(tables, "GROUPED_GEMM", table)
        configs.clear()
        ops.moe_mlp(x, r, gu, dn, top_k, True, residual=x)
        assert configs[0] == rule and configs[1].block_m == rule.block_m


def test_the_expert_layouts_lower_without_a_loop():
    """Routing's row layouts (sorted_items for the Triton grouped GEMM, expert_tiles for the Mosaic one) are straight
    XLA ops: a loop in them (jnp.searchsorted's default method) runs on the GPU with the host checking each
    iteration, ~6 us an iteration, eight a layer at 128 experts."""
    experts = jnp.zeros((64, 8), jnp.int32)

    def layouts(experts):
        order, sizes = reference.sort_by_expert(experts, 128)
        t = et.expert_tiles(order, sizes, 128)
        return sorted_items(sizes, 512, 64), t.source, t.position, t.tile_expert

    hlo = jax.jit(layouts).lower(experts).as_text()
    assert "while" not in hlo
