"""The Mosaic GPU GEMM (pallas/hopper_gemm.py) in Mosaic GPU's interpret mode on the CPU, against the reference
ops at several tilings with fresh random inputs; its shape checks; its configs through the lowering for CUDA
(no GPU needed); and the pallas ops taking it for prompt rows where its table has the product. The same for its W8A8
form (8-bit rows and weights, the scales in the epilogue) against XLA's W8A8 product."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import LayerWeight, get_ops, reference, twins
from jaxinfer.ops.quantized import QuantizedWeight, quantize, quantize_rows
from jaxinfer.pallas import hopper_gemm, tables
from jaxinfer.pallas.blocks import silu_mul
from jaxinfer.pallas.hopper_gemm import HopperConfig

SMALL = HopperConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_n=32)


def _inputs(seed, M, N, K, cols):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(ks[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (N, K), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    r = jax.random.normal(ks[2], (M, cols), jnp.float32).astype(jnp.bfloat16)
    return x, w, r


def _close(y, ref):
    """float32 sums in another order: outputs equal after rounding to bf16, or a bf16 step or two apart (a
    product one step off, then the residual add's own rounding)."""
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=2 ** -6, atol=2 ** -6)
    assert np.mean(y == ref) > 0.99


@pytest.mark.parametrize("epilogue", hopper_gemm.EPILOGUES)
@pytest.mark.parametrize("M, N, K, config", [
    (128, 128, 64, SMALL),                                        # one tile, one k step
    (256, 192, 320, SMALL),                                       # several tiles and k steps, 3 CTAs
    (128, 256, 128, HopperConfig(64, 128, 64, 3, epi_n=64)),      # a wider tile, one epilogue tile a half
    (128, 128, 192, HopperConfig(64, 32, 64, 2, epi_n=16)),       # 4 column tiles, 2 epilogue tiles each
])
def test_matches_reference_in_interpret_mode(epilogue, M, N, K, config):
    n_w = 2 * N if epilogue == "swiglu" else N
    x, w, r = _inputs(M + N + K, M, n_w, K, N)
    y = hopper_gemm.hopper_gemm(x, w, residual=r if epilogue == "residual" else None, epilogue=epilogue,
                                config=config, sms=3, interpret=True)
    _close(y, twins.hopper_gemm(x, w, r if epilogue == "residual" else None, epilogue))


def test_shapes_that_do_not_tile_are_refused_and_say_why():
    x, w, r = _inputs(0, 192, 128, 64, 128)      # 192 rows: not a multiple of 2 x 64
    assert not hopper_gemm.supported(192, 128, 64, "none", SMALL)
    with pytest.raises(ValueError, match="does not tile"):
        hopper_gemm.hopper_gemm(x, w, config=SMALL, interpret=True)
    with pytest.raises(ValueError, match="residual goes with"):
        hopper_gemm.hopper_gemm(x[:128], w, epilogue="residual", config=SMALL, interpret=True)
    with pytest.raises(ValueError, match="unknown epilogue"):
        hopper_gemm.hopper_gemm(x[:128], w, epilogue="gelu", config=SMALL, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        hopper_gemm.hopper_gemm(x[:128, :32], w, config=SMALL, interpret=True)


def test_table_config_covers_only_measured_rows():
    cfg = hopper_gemm.table_config(1024, 19456, 2560, "swiglu")
    assert cfg is not None and hopper_gemm.supported(1024, 19456, 2560, "swiglu", cfg)
    assert hopper_gemm.table_config(1000, 19456, 2560, "swiglu") is None        # rows not measured
    assert hopper_gemm.table_config(1024, 2560, 9728, "residual") is None       # XLA measured faster
    # W8A8 rows are the format's own: int8's down at 1k won (2026-12-06), fp8's lost to XLA's W8A8; int8's o_proj at
    # 1k lost, at 8k won
    assert hopper_gemm.table_config(1024, 2560, 9728, "residual", "int8") is not None
    assert hopper_gemm.table_config(1024, 2560, 9728, "residual", "fp8") is None
    assert hopper_gemm.table_config(1024, 2560, 4096, "residual", "int8") is None
    assert hopper_gemm.table_config(8192, 2560, 4096, "residual", "int8") is not None


def test_pallas_ops_take_the_kernel_where_the_table_has_the_product(monkeypatch):
    """Prompt rows of a product in the table run the kernel (the epilogue fused) and give the reference ops'
    outputs; a product outside it stays on XLA's GEMM."""
    M, D, I = 256, 128, 128
    monkeypatch.setattr(tables, "HOPPER_GEMM", {(2 * I, D, "swiglu"): ((M, M, SMALL),),
                                                (D, I, "residual"): ((M, M, SMALL),),
                                                (D, D, "none"): ((M, M, SMALL),)})
    calls = []
    real = hopper_gemm.hopper_gemm
    monkeypatch.setattr(hopper_gemm, "hopper_gemm", lambda *a, **k: calls.append(k.get("epilogue", "none"))
                        or real(*a, **{**k, "sms": 3}))
    ops = get_ops("pallas-interpret")
    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    x = jax.random.normal(ks[0], (M, D), jnp.float32).astype(jnp.bfloat16)
    scale = (1 + 0.1 * jax.random.normal(ks[1], (D,))).astype(jnp.bfloat16)
    w_gu = (jax.random.normal(ks[2], (2 * I, D)) / np.sqrt(D)).astype(jnp.bfloat16)
    w_down = (jax.random.normal(ks[3], (D, I)) / np.sqrt(I)).astype(jnp.bfloat16)
    w_q = (jax.random.normal(ks[4], (D, D)) / np.sqrt(D)).astype(jnp.bfloat16)
    h = ops.rms_norm_swiglu(x, scale, 1e-6, w_gu)
    # rounded as the other kernels' SwiGLU epilogues round (silu_mul: silu rounded before the product)
    _close(h, silu_mul(*jnp.split(reference.rms_norm_linear(x, scale, 1e-6, w_gu), 2, axis=-1)))
    _close(ops.linear_residual(h, w_down, None, x), reference.linear_residual(h, w_down, None, x))
    _close(ops.rms_norm_linear(x, scale, 1e-6, w_q), reference.rms_norm_linear(x, scale, 1e-6, w_q))
    assert calls == ["swiglu", "residual", "none"]
    # the split layers' matrices reach the ops as one-layer stacks (model._split_layer): the kernel too
    one_layer = LayerWeight(w_q[None], jnp.int32(0))
    _close(ops.rms_norm_linear(x, scale, 1e-6, one_layer), reference.rms_norm_linear(x, scale, 1e-6, w_q))
    assert calls == ["swiglu", "residual", "none", "none"]
    ops.rms_norm_linear(x[:128], scale, 1e-6, w_q)       # 128 rows: not in the table, XLA's GEMM
    ops.rms_norm_linear(x, scale, 1e-6, LayerWeight(jnp.stack([w_q, w_q]), jnp.int32(1)))   # a deeper stack
    assert calls == ["swiglu", "residual", "none", "none"]


@pytest.mark.parametrize("M, N, K, epilogue, config",
                         [(M, N, K, ep, cfg) for (N, K, ep), rows in tables.HOPPER_GEMM.items() for M, _, cfg in rows])
def test_configs_lower_for_the_gpu(M, N, K, epilogue, config):
    """Every config of the table goes through Mosaic GPU's lowering for CUDA (here,
    without a GPU): its layouts, and its shared memory within the H200's 227 KB, are checked before device time
    is spent (a config over the limit fails here with "exceeds available shared memory")."""
    cols = N // 2 if epilogue == "swiglu" else N
    x, w = jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((N, K), jnp.bfloat16)
    r = jax.ShapeDtypeStruct((M, cols), jnp.bfloat16) if epilogue == "residual" else None
    f = functools.partial(hopper_gemm.hopper_gemm, epilogue=epilogue, config=config, sms=132)
    text = jax.jit(f).trace(x, w, residual=r).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_a_config_over_the_shared_memory_fails_to_lower():
    x, w = jax.ShapeDtypeStruct((1024, 2560), jnp.bfloat16), jax.ShapeDtypeStruct((19456, 2560), jnp.bfloat16)
    f = functools.partial(hopper_gemm.hopper_gemm, epilogue="swiglu", config=HopperConfig(64, 256, 64, 8), sms=132)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",))


def test_the_kernel_needs_a_hopper_gpu():
    """Off a Hopper GPU (here: the CPU) the pallas ops keep prompt rows on XLA's GEMM even at a table's shape
    (wgmma and TMA are sm_90 instructions); only interpret mode takes the kernel there."""
    assert not hopper_gemm.available()
    M, N, K = 1024, 6144, 2560
    assert hopper_gemm.table_config(M, N, K, "none") is not None
    ops = get_ops("pallas")
    x = jnp.ones((M, K), jnp.bfloat16)
    w = jnp.ones((N, K), jnp.bfloat16)
    scale = jnp.ones((K,), jnp.bfloat16)
    text = jax.jit(lambda x, s, w: ops.rms_norm_linear(x, s, 1e-6, w)).lower(x, scale, w).as_text()
    assert "mosaic" not in text.lower() and "dot_general" in text


# --- W8A8: 8-bit x and weights, the scales in the epilogue ------------------------------------------------------

SMALL_8BIT = HopperConfig(tile_m=64, tile_n=64, tile_k=128, stages=2, epi_n=32)


def _w8a8_inputs(seed, M, N, K, cols, fmt):
    """x's rows quantized as the ops quantize them (quantize_rows), weights quantized a channel at a time."""
    x, _, r = _inputs(seed, M, N, K, cols)
    x = x * jnp.exp(jax.random.normal(jax.random.PRNGKey(seed + 1), (M, 1))).astype(jnp.bfloat16)   # rows' scales vary
    q = quantize(jax.random.normal(jax.random.PRNGKey(seed + 2), (N, K), jnp.float32) / np.sqrt(K), fmt)
    return x, q, r


def _w8a8_call(x, q, r, epilogue, config, sms=3):
    xq, xs = quantize_rows(x, q.dtype)
    return hopper_gemm.hopper_gemm(xq, q.values, residual=r if epilogue == "residual" else None, epilogue=epilogue,
                                   x_scale=xs, w_scale=q.scale, out_dtype=x.dtype, config=config, sms=sms,
                                   interpret=True)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("epilogue", hopper_gemm.EPILOGUES)
@pytest.mark.parametrize("M, N, K, config", [
    (128, 128, 128, SMALL_8BIT),                                     # one tile, one k step
    (256, 192, 384, SMALL_8BIT),                                     # several tiles and k steps, 3 CTAs
    (128, 128, 192, HopperConfig(64, 32, 64, 2, epi_n=16)),          # 64-byte rows (swizzle 64), 4 column tiles
])
def test_w8a8_matches_xlas_w8a8_product_in_interpret_mode(fmt, epilogue, M, N, K, config):
    """int8 sums are exact in int32 and the scales multiply in XLA's order: the outputs equal XLA's W8A8 product bit
    for bit. e4m3 products summed in float32 in another order: equal after rounding, or a bf16 step or two apart."""
    n_w = 2 * N if epilogue == "swiglu" else N
    x, q, r = _w8a8_inputs(M + N + K, M, n_w, K, N, fmt)
    y, want = _w8a8_call(x, q, r, epilogue, config), twins.hopper_gemm_w8a8(x, q, r, epilogue)
    assert y.dtype == jnp.bfloat16 and y.shape == (M, N)
    if fmt == "int8":
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    else:
        _close(y, want)
    # and the activations' rounding is in it: the bf16 product of the same weights differs
    unquantized = twins.hopper_gemm(x, q.dequantize(jnp.bfloat16), r if epilogue == "residual" else None, epilogue)
    assert not np.array_equal(np.asarray(y, np.float32), np.asarray(unquantized, np.float32))


def test_w8a8_scales_are_checked():
    x, q, _ = _w8a8_inputs(0, 128, 128, 128, 128, "int8")
    xq, xs = quantize_rows(x, q.dtype)
    call = functools.partial(hopper_gemm.hopper_gemm, config=SMALL_8BIT, interpret=True)
    with pytest.raises(ValueError, match="take x_scale, w_scale and out_dtype"):
        call(xq, q.values)
    with pytest.raises(ValueError, match="take x_scale, w_scale and out_dtype"):
        call(x, q.dequantize(jnp.bfloat16), x_scale=xs, w_scale=q.scale, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="want float32"):
        call(xq, q.values, x_scale=xs[:64], w_scale=q.scale, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="want float32"):
        call(xq, q.values, x_scale=xs, w_scale=q.scale.astype(jnp.bfloat16), out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="do not match"):
        call(xq, quantize(q.dequantize(), "fp8").values, x_scale=xs, w_scale=q.scale, out_dtype=jnp.bfloat16)


# The configs part 16 of experiments/gpu_round_next.sh sweeps (bench/kernels/hopper_gemm.py --w8a8) at Qwen3-4B's
# prompt shapes: each must lower before device time is spent on it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels.hopper_gemm import W8A8_CONFIGS, W8A8_SWIGLU_CONFIGS  # noqa: E402


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("epilogue, N, K, configs", [("none", 6144, 2560, W8A8_CONFIGS),
                                                      ("residual", 2560, 9728, W8A8_CONFIGS),
                                                      ("swiglu", 19456, 2560, W8A8_SWIGLU_CONFIGS)])
@pytest.mark.parametrize("M", [1024, 8192])
def test_w8a8_configs_lower_for_the_gpu(dtype, epilogue, N, K, configs, M):
    """8-bit wgmma takes both operands K-major (no transposes): x's rows and the weights' rows as stored. Each
    config lowers through Mosaic GPU for CUDA at Qwen3-4B's shapes, within the shared memory."""
    cols = N // 2 if epilogue == "swiglu" else N
    lowered = 0
    for config in configs:
        if not hopper_gemm.supported(M, N, K, epilogue, config):
            continue
        S = jax.ShapeDtypeStruct
        r = S((M, cols), jnp.bfloat16) if epilogue == "residual" else None
        f = functools.partial(hopper_gemm.hopper_gemm, epilogue=epilogue, config=config, sms=132,
                              out_dtype=jnp.bfloat16)
        text = jax.jit(f).trace(S((M, K), dtype), S((N, K), dtype), residual=r, x_scale=S((M,), jnp.float32),
                                w_scale=S((N,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        lowered += 1
    assert lowered >= 2


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_pallas_ops_take_w8a8_where_the_8bit_table_has_the_product(monkeypatch, fmt):
    """Prompt rows of per-channel 8-bit weights in tables.HOPPER_GEMM_8BIT run the kernel in W8A8 (the norm in XLA,
    then the rows' quantization) and give XLA's W8A8 product's outputs; block-scaled weights of the same shape and
    rows outside the table, and the other 8-bit format's weights, stay on XLA's product."""
    M, D, I = 256, 128, 128
    monkeypatch.setattr(tables, "HOPPER_GEMM_8BIT", {(2 * I, D, "swiglu", fmt): ((M, M, SMALL_8BIT),),
                                                     (D, I, "residual", fmt): ((M, M, SMALL_8BIT),),
                                                     (D, D, "none", fmt): ((M, M, SMALL_8BIT),)})
    calls = []
    real = hopper_gemm.hopper_gemm
    monkeypatch.setattr(hopper_gemm, "hopper_gemm", lambda *a, **k: calls.append((k.get("epilogue", "none"),
                                                                                     a[0].dtype))
                        or real(*a, **{**k, "sms": 3}))
    ops = get_ops("pallas-interpret")
    ks = jax.random.split(jax.random.PRNGKey(8), 5)
    x = jax.random.normal(ks[0], (M, D), jnp.float32).astype(jnp.bfloat16)
    scale = (1 + 0.1 * jax.random.normal(ks[1], (D,))).astype(jnp.bfloat16)
    w_gu, w_down, w_q = (quantize(jax.random.normal(k, shape) / np.sqrt(shape[1]), fmt)
                         for k, shape in zip(ks[2:], [(2 * I, D), (D, I), (D, D)]))
    check = (lambda y, want: np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
             ) if fmt == "int8" else _close
    normed = reference.rms_norm(x, scale, 1e-6)
    h = ops.rms_norm_swiglu(x, scale, 1e-6, w_gu)
    check(h, twins.hopper_gemm_w8a8(normed, w_gu, None, "swiglu"))
    check(ops.linear_residual(h, w_down, None, x), twins.hopper_gemm_w8a8(h, w_down, x, "residual"))
    check(ops.rms_norm_linear(x, scale, 1e-6, LayerWeight(jax.tree.map(lambda a: a[None], w_q), jnp.int32(0))),
          twins.hopper_gemm_w8a8(normed, w_q, None, "none"))
    eight = jnp.dtype(quantize(w_q.values[:1].astype(jnp.float32), fmt).dtype)
    assert calls == [("swiglu", eight), ("residual", eight), ("none", eight)]
    ops.rms_norm_linear(x[:128], scale, 1e-6, w_q)            # 128 rows: not in the table, XLA's product
    blocked = QuantizedWeight(w_q.values, jnp.ones((4, 4), jnp.float32), (32, 32))
    ops.rms_norm_linear(x, scale, 1e-6, blocked)              # block scales: XLA's product
    other = quantize(w_q.dequantize(jnp.float32), "fp8" if fmt == "int8" else "int8")
    ops.rms_norm_linear(x, scale, 1e-6, other)                # the other format: its own rows, none here
    ops.rms_norm_linear(x, scale, 1e-6, q_bf16 := w_q.dequantize(jnp.bfloat16))   # bf16: HOPPER_GEMM, empty here
    assert len(calls) == 3 and q_bf16.dtype == jnp.bfloat16
