"""The routed GEMVs of a batch-1 mixture-of-experts step (pallas/moe_gemv.py) in interpret mode against the
reference ops: routing read from the logits in the kernel (experts not a power of two, with and without
renormalisation), depths that are not multiples of the tile, 1-4 rows a program, a layer of a [L, E, N, K] stack,
the combine with and without the residual, depths run as a loop.

Tolerances: float32 1e-5 relative (another summation order); bfloat16 1e-2 relative (outputs round to bf16; SwiGLU
rounds silu in float32 where the reference rounds it in bf16).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxinfer.ops import reference
from jaxinfer.pallas.moe_gemv import routed_gemv

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
HP = jax.lax.Precision.HIGHEST
# (E, top_k, D, I, block_in, rows)
# (the last: depths of more than UNROLL_TILES tiles, a loop; the combine's with a ragged tail)
CASES = [(6, 3, 72, 40, 32, None), (8, 2, 64, 48, 64, 2), (5, 5, 40, 24, 16, 1), (16, 4, 128, 64, 512, 4),
         (4, 2, 272, 300, 16, None)]


def _operands(case, dtype, L=2):
    E, k, D, I, _, _ = CASES[case]
    keys = jax.random.split(jax.random.PRNGKey(case), 5)
    x = jax.random.normal(keys[0], (1, D), jnp.float32).astype(dtype)
    logits = (2 * jax.random.normal(keys[1], (1, E), jnp.float32)).astype(dtype)
    gate_up = (jax.random.normal(keys[2], (L, E, 2 * I, D)) / np.sqrt(D)).astype(dtype)
    down = (jax.random.normal(keys[3], (L, E, D, I)) / np.sqrt(I)).astype(dtype)
    residual = jax.random.normal(keys[4], (1, D), jnp.float32).astype(dtype)
    return x, logits, gate_up, down, residual


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_routed_gemvs_match_reference(case, renormalize, dtype):
    E, k, D, I, block_in, rows = CASES[case]
    x, logits, gate_up, down, residual = _operands(case, dtype)
    layer = 1
    weights, experts = reference.route(logits, k, renormalize)
    kw = dict(top_k=k, renormalize=renormalize, block_in=block_in, interpret=True)
    h = routed_gemv(x, logits, gate_up, layer, epilogue="swiglu", rows=rows, **kw)
    h_ref = reference.swiglu(jnp.einsum("d,knd->kn", x[0], gate_up[layer, experts[0]], precision=HP,
                                        preferred_element_type=jnp.float32).astype(dtype))
    assert h.shape == (k, I) and h.dtype == dtype
    assert rel_err(h, h_ref) <= TOL[dtype]
    y_ref = jnp.einsum("ki,kdi->kd", h_ref, down[layer, experts[0]], precision=HP,
                       preferred_element_type=jnp.float32).astype(dtype)
    out_ref = jnp.sum(y_ref.astype(jnp.float32) * weights[0][:, None], axis=0).astype(dtype)[None]
    out = routed_gemv(h_ref, logits, down, layer, epilogue="combine", rows=rows if rows != 4 or D % 4 == 0 else None,
                      **kw)
    assert out.shape == (1, D) and rel_err(out, out_ref) <= TOL[dtype]
    with_res = routed_gemv(h_ref, logits, down, layer, epilogue="combine", residual=residual, **kw)
    assert rel_err(with_res, residual + out_ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", [0, 1, 3])
def test_routes_emitted_by_the_swiglu_drive_the_combine(case, dtype):
    """The op's chain: the gate/up kernel routes once and writes its routes; the combine takes them (and any
    routes: reference.route's) instead of routing again. Bit for bit the outputs of routing in each kernel."""
    E, k, D, I, block_in, rows = CASES[case]
    x, logits, gate_up, down, residual = _operands(case, dtype)
    kw = dict(top_k=k, renormalize=True, block_in=block_in, interpret=True)
    h_own = routed_gemv(x, logits, gate_up, 1, epilogue="swiglu", rows=rows, **kw)
    h, routes = routed_gemv(x, logits, gate_up, 1, epilogue="swiglu", rows=rows, emit_routes=True, **kw)
    weights, experts = reference.route(logits, k, True)
    np.testing.assert_array_equal(np.asarray(routes[0]), np.asarray(experts[0]))
    np.testing.assert_allclose(np.asarray(routes[1]), np.asarray(weights[0], np.float32), rtol=1e-6)   # sum order
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_own, np.float32))
    routed = routed_gemv(h, None, down, 1, epilogue="combine", residual=residual, routes=routes, **kw)
    own = routed_gemv(h, logits, down, 1, epilogue="combine", residual=residual, **kw)
    np.testing.assert_array_equal(np.asarray(routed, np.float32), np.asarray(own, np.float32))
    by_reference = routed_gemv(x, None, gate_up, 1, epilogue="swiglu", rows=rows,
                               routes=(experts[0], weights[0]), **kw)
    np.testing.assert_array_equal(np.asarray(by_reference, np.float32), np.asarray(h_own, np.float32))
    combined = routed_gemv(h, None, down, 1, epilogue="combine", routes=(experts[0], weights[0]), **kw)
    assert rel_err(combined, routed_gemv(h, logits, down, 1, epilogue="combine", **kw)) <= TOL[dtype]


def test_bad_operands_are_one_clear_error():
    x, logits, gate_up, down, residual = _operands(0, jnp.float32)
    kw = dict(top_k=3, renormalize=True, interpret=True)
    with pytest.raises(ValueError, match="logits"):
        routed_gemv(x, logits[:, :5], gate_up, epilogue="swiglu", **kw)
    with pytest.raises(ValueError, match="does not fit"):
        routed_gemv(x[:, :5], logits, gate_up, epilogue="swiglu", **kw)
    with pytest.raises(ValueError, match="routes are"):
        routed_gemv(x, None, gate_up, epilogue="swiglu", routes=(jnp.zeros(2, jnp.int32), jnp.zeros(2)), **kw)
    with pytest.raises(ValueError, match="emit_routes"):
        routed_gemv(x, logits, down, epilogue="combine", emit_routes=True, **kw)
    with pytest.raises(ValueError, match="takes x of 3 rows"):
        routed_gemv(jnp.zeros((1, 40)), logits, down, epilogue="combine", **kw)
    with pytest.raises(ValueError, match="top_k"):
        routed_gemv(x, logits, gate_up, epilogue="swiglu", top_k=7, renormalize=True, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_norm_prologue_matches_rms_norm_first(dtype):
    """swiglu with scale: rms_norm(x) folded in, the scale read at its own layer of a [L, D] stack (the split
    layers' one-layer matrix with stacked vectors)."""
    E, k, D, I, block_in, _ = CASES[0]
    x, logits, gate_up, _, _ = _operands(0, dtype)
    scale = (1 + 0.2 * jax.random.normal(jax.random.PRNGKey(9), (3, D))).astype(dtype)
    h = routed_gemv(x, logits, gate_up[1][None], 0, top_k=k, renormalize=False, epilogue="swiglu", scale=scale,
                    eps=1e-5, vector_layer=2, block_in=block_in, interpret=True)
    ref = routed_gemv(reference.rms_norm(x, scale[2], 1e-5), logits, gate_up, 1, top_k=k, renormalize=False,
                      epilogue="swiglu", block_in=block_in, interpret=True)
    assert rel_err(h, ref) <= TOL[dtype]
