"""The mixture-of-experts kernels through ops.pallas.moe_mlp / rms_norm_moe_mlp on the GPU at real shapes, against
the reference ops (ragged_dot), with the configs choose_config picks: Qwen3-30B-A3B (128 experts of 768, 8 active,
D 2048) and Mixtral-8x7B (8 experts of 14336, 2 active, D 4096); one token (the routed GEMVs), batched decode and
prompt rows (the grouped GEMM over sorted rows); moe_mlp and rms_norm_moe_mlp (the norm folded into the batch-1 GEMVs).

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_grouped_gemm_gpu.py
Tolerance: relative Frobenius error 1e-2 in bf16 for the MoE output (output rounding alone is ~4e-3 per element); 3e-2
for what the block (x + MoE, rounded to bf16) adds to x, whose rounding flips take their share.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import LayerWeight, get_ops, reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

# (name, experts, active, D, I)
SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768), ("mixtral-8x7b", 8, 2, 4096, 14336)]


def _rel(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(y))
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("T", [1, 8, 64, 1024])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_moe_mlp_at_real_shapes(shape, T):
    _, E, k, D, I = shape
    keys = jax.random.split(jax.random.PRNGKey(T + E), 4)
    L = 2
    x = jax.random.normal(keys[0], (T, D), jnp.bfloat16)
    router = jax.random.normal(keys[1], (L, E, D), jnp.bfloat16) * jnp.bfloat16(D ** -0.5)
    gate_up = jax.random.normal(keys[2], (L, E, 2 * I, D), jnp.bfloat16) * jnp.bfloat16(D ** -0.5)
    down = jax.random.normal(keys[3], (L, E, D, I), jnp.bfloat16) * jnp.bfloat16(I ** -0.5)

    scale = (1 + 0.1 * jax.random.normal(keys[0], (L, D))).astype(jnp.bfloat16)

    def run(ops):   # layer 1 of the stacks, read in place: the MoE op, and the block with its norm folded in
        moe = jax.jit(lambda *ws: ops.moe_mlp(x, *(LayerWeight(w, jnp.int32(1)) for w in ws), k, True))(
            router, gate_up, down)
        block = jax.jit(lambda s, *ws: ops.rms_norm_moe_mlp(x, LayerWeight(s, jnp.int32(1)), 1e-6, *(
            LayerWeight(w, jnp.int32(1)) for w in ws), k, True))(scale, router, gate_up, down)
        return moe, block

    (moe, block), (moe_ref, block_ref) = run(get_ops("pallas")), run(reference)
    assert _rel(moe, moe_ref) <= 1e-2
    # The block is x + the experts' output rounded to bf16: where the MoE sums differ in their last bit, the rounding
    # of x + moe lands one ulp of x apart. On the H200 at Qwen3-30B-A3B's shape and one token (the norm folded into the
    # routed GEMVs) those flips alone put block - x 1.3% from the reference's in Frobenius norm; an element-wise one-ulp
    # bound does not hold where x and the experts' output cancel.
    assert np.all(np.isfinite(np.asarray(block, np.float64)))
    assert _rel(block - x, block_ref - x) <= 3e-2


def _fp8_blocks(w, block=(128, 128)):
    """w [..., out, in] in e4m3 with one scale a 128 x 128 block (Qwen3-30B-A3B-FP8's layout)."""
    from jaxinfer.ops.quantized import QuantizedWeight

    bo, bi = block
    *lead, out, inp = w.shape
    amax = jnp.abs(w.astype(jnp.float32)).reshape(*lead, out // bo, bo, inp // bi, bi).max(axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    full = jnp.repeat(jnp.repeat(scale, bo, axis=-2), bi, axis=-1)
    return QuantizedWeight((w.astype(jnp.float32) / full).astype(jnp.float8_e4m3fn), scale, block)


@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_8bit_experts_at_real_shapes(shape, fmt, T):
    """One token through the 8-bit routed GEMVs, 64 through the 8-bit grouped GEMM (int8 / e4m3 expert stacks, one
    scale an expert's row, or e4m3 with one a 128 x 128 block), against the reference's grouped product of the same
    QuantizedWeights."""
    from jaxinfer.ops.quantized import quantize

    def quantized(w):
        return _fp8_blocks(w) if fmt == "fp8-block" else quantize(w, fmt)

    _, E, k, D, I = shape
    keys = jax.random.split(jax.random.PRNGKey(E), 4)
    x = jax.random.normal(keys[0], (T, D), jnp.bfloat16)
    router = jax.random.normal(keys[1], (2, E, D), jnp.bfloat16) * jnp.bfloat16(D ** -0.5)
    gate_up = quantized(jax.random.normal(keys[2], (2, E, 2 * I, D), jnp.bfloat16) * jnp.bfloat16(D ** -0.5))
    down = quantized(jax.random.normal(keys[3], (2, E, D, I), jnp.bfloat16) * jnp.bfloat16(I ** -0.5))
    scale = (1 + 0.1 * jax.random.normal(keys[0], (2, D))).astype(jnp.bfloat16)

    def run(ops):
        return jax.jit(lambda s, r, g, d: ops.rms_norm_moe_mlp(x, LayerWeight(s, jnp.int32(1)), 1e-6, *(
            LayerWeight(w, jnp.int32(1)) for w in (r, g, d)), k, True))(scale, router, gate_up, down)

    block, block_ref = run(get_ops("pallas")), run(reference)
    assert np.all(np.isfinite(np.asarray(block, np.float64)))
    assert _rel(block - x, block_ref - x) <= 3e-2


@pytest.mark.parametrize("T", [64, 1024])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_8bit_experts_in_w8a8_at_real_shapes(monkeypatch, shape, fmt, T):
    """Rows through the grouped GEMM in W8A8 (tables.GROUPED_W8A8_ROWS = 1: x's rows and the SwiGLU's quantized, 8-bit
    tile products) against the reference's grouped product of the same QuantizedWeights (weight-only, the
    activations unquantized): the activations' rounding costs about what weight-only 8 bits cost, far below a wrong
    tile's error."""
    from jaxinfer.ops.quantized import quantize
    from jaxinfer.pallas import tables

    monkeypatch.setattr(tables, "GROUPED_W8A8_ROWS", 1)
    jax.clear_caches()
    _, E, k, D, I = shape
    keys = jax.random.split(jax.random.PRNGKey(E + T), 4)
    x = jax.random.normal(keys[0], (T, D), jnp.bfloat16)
    router = jax.random.normal(keys[1], (2, E, D), jnp.bfloat16) * jnp.bfloat16(D ** -0.5)
    gate_up = quantize(jax.random.normal(keys[2], (2, E, 2 * I, D), jnp.bfloat16) * jnp.bfloat16(D ** -0.5), fmt)
    down = quantize(jax.random.normal(keys[3], (2, E, D, I), jnp.bfloat16) * jnp.bfloat16(I ** -0.5), fmt)

    def run(ops):
        return jax.jit(lambda r, g, d: ops.moe_mlp(x, *(LayerWeight(w, jnp.int32(1)) for w in (r, g, d)), k, True))(
            router, gate_up, down)

    got, ref = run(get_ops("pallas")), run(reference)
    assert _rel(got, ref) <= (3e-2 if fmt == "int8" else 6e-2)
