"""ops.pallas reaches the 8-bit GEMV tables (tables.GEMV_ROWS_8BIT, GEMV_INT8_CONVERT_BY_SHAPE) under the keys the
kernel bench measures them by: (out, in) of the matrix, SwiGLU's gate rows for the fused gate/up, the lm_head's
[vocab, hidden]. Read from the traced kernel (its grid and whether it converts int8 by bit logic), nothing run.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.ops import LayerWeight, get_ops
from jaxinfer.ops.quantized import QuantizedWeight
from jaxinfer.pallas import tables

OPS = get_ops("pallas-interpret")


def int8_conversions(jaxpr) -> set[str]:
    """How jaxpr and the jaxprs nested in it (loop bodies, branches) convert int8 values: "cvt" (straight to
    float32) or "bits" (to int32 first, weights_to_f32's bit logic)."""
    def inner(v):
        if isinstance(v, (tuple, list)):
            return [j for x in v for j in inner(x)]
        j = getattr(v, "jaxpr", v)
        return [j] if hasattr(j, "eqns") else []

    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype == jnp.int8:
            to = jnp.dtype(eqn.params["new_dtype"])
            found.add({jnp.dtype(jnp.float32): "cvt", jnp.dtype(jnp.int32): "bits"}.get(to, str(to)))
        for j in (j for v in eqn.params.values() for j in inner(v)):
            found |= int8_conversions(j)
    return found


def gemv_kernels(f, *args):
    """(grid, its int8 conversions) of each Pallas kernel f traces (f a fresh function: make_jaxpr caches a trace
    by the function and the arguments' shapes, not by the tables it read)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append((eqn.params["grid_mapping"].grid, int8_conversions(eqn.params["jaxpr"])))
            elif "jaxpr" in eqn.params:   # a nested jit
                walk(eqn.params["jaxpr"].jaxpr)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


def int8_stack(L, n_out, n_in):
    values = jax.random.randint(jax.random.PRNGKey(n_out + n_in), (L, n_out, n_in), -127, 128).astype(jnp.int8)
    return QuantizedWeight(values, jnp.full((L, n_out), 1e-3, jnp.float32), None)


@pytest.mark.parametrize("convert", ["bits", "cvt"])
def test_logits_read_rows_and_conversion_by_vocab_and_hidden(monkeypatch, convert):
    w = int8_stack(1, 96, 256)[0]
    x = jnp.ones((1, 256), jnp.bfloat16)
    monkeypatch.setitem(tables.GEMV_ROWS_8BIT, (96, 256), 2)
    monkeypatch.setitem(tables.GEMV_INT8_CONVERT_BY_SHAPE, (96, 256), convert)
    assert gemv_kernels(lambda x, w: OPS.logits(x, w), x, w) == [((48,), {convert})]


@pytest.mark.parametrize("convert", ["bits", "cvt"])
def test_swiglu_reads_conversion_by_gate_rows(monkeypatch, convert):
    qw = int8_stack(2, 96, 64)                 # gate and up rows: 48 each
    x = jnp.ones((1, 64), jnp.bfloat16)
    scale = LayerWeight(jnp.ones((2, 64), jnp.bfloat16), jnp.int32(1))
    other = "cvt" if convert == "bits" else "bits"
    monkeypatch.setitem(tables.GEMV_INT8_CONVERT_BY_SHAPE, (48, 64), convert)
    monkeypatch.setitem(tables.GEMV_INT8_CONVERT_BY_SHAPE, (96, 64), other)   # the whole matrix's key: not read
    f = lambda x, qw: OPS.rms_norm_swiglu(x, scale, 1e-6, LayerWeight(qw, jnp.int32(1)))
    assert gemv_kernels(f, x, qw) == [((48,), {convert})]


def test_unlisted_shapes_take_the_default_conversion(monkeypatch):
    qw = int8_stack(2, 40, 64)
    x = jnp.ones((1, 64), jnp.bfloat16)
    for default in ("bits", "cvt"):
        monkeypatch.setattr(tables, "GEMV_INT8_CONVERT", default)
        f = lambda x, qw: OPS.linear(x, LayerWeight(qw, jnp.int32(0)))
        assert gemv_kernels(f, x, qw) == [((40,), {default})]
