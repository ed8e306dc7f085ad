"""The grouped Mosaic GPU GEMM for a mixture of experts' prompt rows: the padded layout (pallas/expert_tiles.py),
hopper_gemm's row_tile_group in Mosaic GPU's interpret mode against each tile's own product, its lowering for CUDA,
its refusals, and ops.pallas.moe_mlp taking it where tables.HOPPER_GROUPED_GEMM has both products."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import moe_block
from jaxinfer.ops import LayerWeight, get_ops, reference, twins
from jaxinfer.pallas import expert_tiles as et
from jaxinfer.pallas import hopper_gemm, tables
from jaxinfer.pallas.hopper_gemm import HopperConfig

SMALL = HopperConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_n=32)
bf16 = jnp.bfloat16


@pytest.mark.parametrize("T, top_k, E, tile", [(40, 2, 4, 128), (7, 8, 128, 16), (300, 2, 8, 64), (1, 1, 3, 8)])
def test_the_padded_layout_holds_each_assignment_once_and_one_expert_a_tile(T, top_k, E, tile):
    key = jax.random.PRNGKey(T + E)
    # a skewed routing: most assignments on few experts, some experts with none
    experts = jax.random.categorical(key, jnp.log(jnp.arange(E, 0, -1.0) ** 3), shape=(T, top_k)).astype(jnp.int32)
    t = et.expert_tiles(*reference.sort_by_expert(experts, E), tile)
    A, P = T * top_k, et.padded_rows(T * top_k, E, tile)
    a, src, pos, te = (np.asarray(v) for v in (experts.reshape(-1), t.source, t.position, t.tile_expert))
    assert src.shape == (P,) and pos.shape == (A,) and te.shape == (P // tile,)
    np.testing.assert_array_equal(src[pos], np.arange(A))               # each assignment at its row, once
    assert np.sum(src < A) == A and np.all(src[src >= A] == A)           # the rest padding
    for i, e in enumerate(te):
        rows = src[i * tile:(i + 1) * tile]
        real = rows[rows < A]
        if e < 0:
            assert real.size == 0                                        # skipped tiles hold no assignment
        else:
            assert np.all(a[real] == e) and real.size > 0                # one expert a tile, never an empty one
            assert np.all(rows[:real.size] < A)                          # its rows first, the padding after
    assert sorted(set(te[te >= 0])) == sorted(set(a))                    # every chosen expert has its tiles
    x = jax.random.normal(key, (T, 16)).astype(bf16)
    g = np.asarray(et.gather_rows(x, t, top_k))
    np.testing.assert_array_equal(g[pos], np.repeat(np.asarray(x), top_k, axis=0))
    assert not g[src >= A].any()                                         # padding rows zero


def _grouped_case(seed, tiles, G, N, K, tile_m, groups):
    ks = jax.random.split(jax.random.PRNGKey(seed), 2)
    x = jax.random.normal(ks[0], (tiles * 2 * tile_m, K), jnp.float32).astype(bf16)
    w = (jax.random.normal(ks[1], (G, N, K), jnp.float32) / np.sqrt(K)).astype(bf16)
    return x, w, jnp.asarray(groups, jnp.int32)


@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
@pytest.mark.parametrize("N, K, config, groups", [
    (128, 128, SMALL, [2, 0, -1]),                                      # a skipped tile last
    (192, 320, SMALL, [1, 1, 3, -1, 0]),                                # a group over two tiles, a skipped one between
    (256, 128, HopperConfig(64, 128, 64, 3, epi_n=64), [0, 2]),
])
def test_grouped_tiles_match_their_own_products_in_interpret_mode(epilogue, N, K, config, groups):
    n_w = 2 * N if epilogue == "swiglu" else N
    cta_m = hopper_gemm.cta_tile(config)[0]
    x, w, g = _grouped_case(N + K + len(groups), len(groups), 4, n_w, K, config.tile_m, groups)
    y = np.asarray(hopper_gemm.hopper_gemm(x, w, epilogue=epilogue, row_tile_group=g, config=config, sms=3,
                                           interpret=True), np.float32)
    assert y.shape == (x.shape[0], N)
    for i, group in enumerate(groups):
        if group < 0:
            continue
        rows = slice(i * cta_m, (i + 1) * cta_m)
        want = np.asarray(twins.hopper_gemm(x[rows], w[group], None, epilogue), np.float32)
        np.testing.assert_allclose(y[rows], want, rtol=2 ** -6, atol=2 ** -6)
        assert np.mean(y[rows] == want) > 0.99


def test_grouped_products_are_checked():
    x, w, g = _grouped_case(0, 2, 3, 128, 64, 64, [0, 1])
    with pytest.raises(ValueError, match="row_tile_group"):
        hopper_gemm.hopper_gemm(x, w, row_tile_group=g[:1], config=SMALL, interpret=True)
    with pytest.raises(ValueError, match="16-bit weights"):
        hopper_gemm.hopper_gemm(x, w[0], row_tile_group=g, config=SMALL, interpret=True)
    with pytest.raises(ValueError, match="16-bit weights"):
        hopper_gemm.hopper_gemm(x, w, residual=x[:, :128], epilogue="residual", row_tile_group=g, config=SMALL,
                                interpret=True)


@pytest.mark.parametrize("E, N, K, epilogue, config, A", [
    (E, N, K, epilogue, config, A) for (E, N, K, epilogue), rows in tables.HOPPER_GROUPED_GEMM.items()
    for first, last, config in rows for A in (first, last)])
def test_grouped_configs_lower_for_the_gpu(E, N, K, epilogue, config, A):
    """Each row of tables.HOPPER_GROUPED_GEMM (Mixtral-8x7B's and Qwen3-30B-A3B's products) at the first and last
    assignment counts it takes, through Mosaic GPU's lowering for CUDA (no GPU needed), the stack read as
    [L * E, N, K]."""
    P = et.padded_rows(A, E, hopper_gemm.cta_tile(config)[0])
    x = jax.ShapeDtypeStruct((P, K), bf16)
    w = jax.ShapeDtypeStruct((2 * E, N, K), bf16)
    g = jax.ShapeDtypeStruct((P // hopper_gemm.cta_tile(config)[0],), jnp.int32)
    f = functools.partial(hopper_gemm.hopper_gemm, epilogue=epilogue, config=config, sms=132)
    text = jax.jit(f).trace(x, w, row_tile_group=g).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_moe_mlp_takes_the_grouped_kernel_where_the_table_has_both_products(monkeypatch):
    """The pallas ops' mixture of experts on prompt rows through the grouped Mosaic GEMM (the tables' rows for both
    products), a layer of a deeper stack read in place: the reference's outputs; without the down's row, or at
    another row count, the Triton grouped GEMM."""
    T, D, I, E, top_k = 40, 64, 64, 4, 2
    x, r, gu, dn, want, (router, w_gu, w_dn, layer) = moe_block(T, D, I, E, top_k, seed=3)

    calls = []
    real = hopper_gemm.hopper_gemm
    monkeypatch.setattr(hopper_gemm, "hopper_gemm", lambda *a, **k: calls.append(k.get("epilogue", "none"))
                        or real(*a, **{**k, "sms": 3}))
    ops = get_ops("pallas-interpret")
    rows = T * top_k
    monkeypatch.setattr(tables, "HOPPER_GROUPED_GEMM", {})
    triton = np.asarray(ops.moe_mlp(x, r, gu, dn, top_k, True, residual=x), np.float32)
    monkeypatch.setattr(tables, "HOPPER_GROUPED_GEMM", {(E, 2 * I, D, "swiglu"): ((rows, rows, SMALL),),
                                                       (E, D, I, "none"): ((rows, rows, SMALL),)})
    got = np.asarray(ops.moe_mlp(x, r, gu, dn, top_k, True, residual=x), np.float32)
    assert calls == ["swiglu", "none"]
    # within the bf16 steps of the reference's own rounding (its grouped product sums in another order: the Triton
    # grouped GEMM is 66% equal to it here), and the Triton grouped GEMM's outputs nearly everywhere
    np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=2 ** -5)
    assert np.mean(np.abs(got - want)) <= 1.1 * np.mean(np.abs(triton - want))
    assert np.mean(got == triton) > 0.97

    ops.moe_mlp(x[:20], r, gu, dn, top_k, True, residual=x[:20])        # 40 assignments: not in the table
    monkeypatch.setattr(tables, "HOPPER_GROUPED_GEMM", {(E, 2 * I, D, "swiglu"): ((rows, rows, SMALL),)})
    ops.moe_mlp(x, r, gu, dn, top_k, True, residual=x)                   # the down's row missing
    monkeypatch.setattr(tables, "HOPPER_GROUPED_GEMM", {(E, 2 * I, D, "swiglu"): ((rows, rows, SMALL),),
                                                       (E, D, I, "none"): ((rows, rows, SMALL),)})
    f32 = jnp.float32                                                    # float32 experts: bf16 operands only
    ops.moe_mlp(x.astype(f32), LayerWeight(router[None].astype(f32), jnp.int32(0)),
                LayerWeight(w_gu.astype(f32), layer), LayerWeight(w_dn.astype(f32), layer), top_k, True,
                residual=x.astype(f32))
    assert calls == ["swiglu", "none"]


def test_grouped_table_rows_tile_their_products():
    """Every row of tables.HOPPER_GROUPED_GEMM: a config the kernel takes at its product, and at each assignment
    count one CTA row tile for both products of a block (else the block would fall back to the Triton GEMM)."""
    table = tables.HOPPER_GROUPED_GEMM
    assert table
    for (E, N, K, epilogue), rows in table.items():
        for first, last, config in rows:
            assert 0 < first <= last
            assert hopper_gemm.supported(hopper_gemm.cta_tile(config)[0], N, K, epilogue, config)
        if epilogue == "swiglu":
            down = (E, K, N // 2, "none")
            assert down in table
            for a in sorted({r[0] for r in rows} | {r[1] for r in rows} | {r[0] for r in table[down]}):
                up, dn = (hopper_gemm.grouped_table_config(a, E, N, K, "swiglu"),
                          hopper_gemm.grouped_table_config(a, *down))
                assert (up is None) == (dn is None), a
                assert up is None or hopper_gemm.cta_tile(up)[0] == hopper_gemm.cta_tile(dn)[0]
