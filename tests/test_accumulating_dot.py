"""The K loops' products accumulated inside the dot (pallas/accumulating_dot.py, tables.DOT_INTO_ACCUMULATOR): in
interpret mode the kernels give the same bits with it on as off (it is acc + dot_general there, as before); lowered
for an H200, the grouped GEMM's Triton IR then has every product dot accumulate into the loop's carried sums (no
dot into splat zeros and no add of its result), and with it off the old form."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas import tables
from jaxinfer.pallas.accumulating_dot import accumulating_dot
from jaxinfer.pallas.blocks import dot_precision
from jaxinfer.pallas.grouped_gemm import grouped_gemm, sorted_items
from jaxinfer.pallas.skinny_gemm import skinny_gemm


@pytest.fixture
def into_accumulator(monkeypatch):
    def set_(on: bool):
        monkeypatch.setattr(tables, "DOT_INTO_ACCUMULATOR", on)
    return set_


def _both(into_accumulator, fn):
    outs = []
    for on in (False, True):
        into_accumulator(on)
        jax.clear_caches()   # the flag is read at trace time
        outs.append(np.asarray(fn()))
    return outs


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_accumulating_dot_is_acc_plus_the_product(into_accumulator, dtype):
    ka, kb, kc = jax.random.split(jax.random.PRNGKey(0), 3)
    a = jax.random.normal(ka, (16, 32), dtype)
    b = jax.random.normal(kb, (24, 32), dtype)
    acc = jax.random.normal(kc, (16, 24), jnp.float32)
    dims = (((1,), (1,)), ((), ()))
    prec = dot_precision(dtype)
    want = acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                                     precision=jax.lax.Precision.HIGHEST)
    off, on = _both(into_accumulator, lambda: jax.jit(
        lambda a, b, c: accumulating_dot(a, b, c, dims, precision=prec))(a, b, acc))
    np.testing.assert_array_equal(off, on)
    eager = _both(into_accumulator, lambda: accumulating_dot(a, b, acc, dims, precision=prec))   # the primitive's impl
    np.testing.assert_array_equal(eager[1], on)
    np.testing.assert_allclose(on, want, rtol=1e-5, atol=1e-4)


def test_kernels_give_the_same_bits_either_way_in_interpret_mode(into_accumulator):
    key = jax.random.split(jax.random.PRNGKey(1), 8)
    # grouped GEMM (SwiGLU and plain), rows of three experts
    M, E, N, K = 48, 3, 64, 96
    x = jax.random.normal(key[0], (M, K), jnp.bfloat16)
    w = (jax.random.normal(key[1], (1, E, N, K), jnp.float32) * 0.1).astype(jnp.bfloat16)
    items = sorted_items(jnp.array([20, 0, 28], jnp.int32), M, 16)
    for epilogue in ("none", "swiglu"):
        off, on = _both(into_accumulator, lambda: grouped_gemm(x, w, items, epilogue=epilogue, interpret=True))
        np.testing.assert_array_equal(off, on)
    # skinny GEMM
    ws = (jax.random.normal(key[2], (1, N, K), jnp.float32) * 0.1).astype(jnp.bfloat16)
    off, on = _both(into_accumulator, lambda: skinny_gemm(x[:8], ws, interpret=True))
    np.testing.assert_array_equal(off, on)
    # decode attention over pages (the online softmax's p @ v), bf16 pages
    B, H, KVH, hd, ps, P = 2, 8, 2, 64, 16, 6
    q = jax.random.normal(key[3], (B, H, hd), jnp.bfloat16)
    kc = jax.random.normal(key[4], (1, KVH, B * P * ps, hd), jnp.bfloat16)
    vc = jax.random.normal(key[5], (1, KVH, B * P * ps, hd), jnp.bfloat16)
    pt = jnp.arange(B * P, dtype=jnp.int32).reshape(B, P)
    cl = jnp.array([37, 90], jnp.int32)
    off, on = _both(into_accumulator, lambda: DA.paged_decode_attention(q, kc, vc, 0, pt, cl, ps, hd ** -0.5,
                                                                        config=DA.SplitConfig(2, 16),
                                                                        interpret=True))
    np.testing.assert_array_equal(off, on)


def _grouped_ttir() -> str:
    from bench.kernel_registers import triton_modules

    s = jax.ShapeDtypeStruct
    fn = lambda x, w, items: grouped_gemm(x, w, items)
    ((_, module),) = triton_modules(fn, [s((1024, 512), jnp.bfloat16), s((1, 8, 256, 512), jnp.bfloat16),
                                         s((24, 3), jnp.int32)])
    return module


@pytest.mark.parametrize("on", [False, True])
def test_grouped_gemm_dot_accumulates_into_the_loop_sums(into_accumulator, on):
    into_accumulator(on)
    jax.clear_caches()
    ttir = _grouped_ttir()
    splats = set(re.findall(r"(%\w+) = tt\.splat", ttir))
    accumulators = re.findall(r"= tt\.dot %\w+, %\w+, (%\w+)", ttir)
    assert len(accumulators) == 1
    assert (accumulators[0] in splats) != on, accumulators
