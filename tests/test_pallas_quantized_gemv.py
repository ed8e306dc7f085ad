"""The 8-bit weight variants of the decode GEMV (fused_gemv) and the batched-decode GEMM (skinny_gemm), in interpret
mode, against their twin (twins.linear_8bit: the reference ops on the float32 dequantized matrix), at shapes that
are not multiples of the tiles nor of the scale blocks: int8 and float8_e4m3fn values, one scale per output channel
and (bo, bi) block scales, each prologue and epilogue; then ops.pallas's dispatch of every linear op.

Tolerances as tests/test_pallas_fused_gemv.py's: float32 1e-5 relative; bfloat16 2e-2 (the twin rounds the normed
x to bf16 before the product, the GEMV does not; outputs are bf16).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxinfer.ops import LayerWeight, get_ops, reference, twins
from jaxinfer.ops.pallas import xla_w8a8_product
from jaxinfer.ops.quantized import QuantizedWeight
from jaxinfer.pallas.fused_gemv import fused_gemv
from jaxinfer.pallas.skinny_gemm import skinny_gemm
from jaxinfer.pallas.tables import SkinnyConfig

f32, bf16 = jnp.float32, jnp.bfloat16
TOL = {f32: 1e-5, bf16: 2e-2}
KINDS = ["plain", "norm", "norm_bias", "residual", "swiglu"]


def random_weight(key, L, n_out, n_in, fmt, block) -> QuantizedWeight:
    """Random 8-bit values over their whole range and positive scales (per channel, or per block)."""
    kv, ks = jax.random.split(key)
    if fmt == "int8":
        values = jax.random.randint(kv, (L, n_out, n_in), -127, 128).astype(jnp.int8)
        top = 127.0
    else:
        values = jnp.clip(jax.random.normal(kv, (L, n_out, n_in)) * 150, -448, 448).astype(jnp.float8_e4m3fn)
        top = 448.0
    shape = (L, n_out) if block is None else (L, -(-n_out // block[0]), -(-n_in // block[1]))
    scale = jax.random.uniform(ks, shape, f32, 0.5, 2.0) / (top * np.sqrt(n_in))
    return QuantizedWeight(values, scale, block)


def case(kind, n_out, n_in, dtype, fmt, block, T=1, seed=0):
    """(x, the quantized stack, its layer, keyword arguments of the kernels and of the twin)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    L, layer = 3, 1
    x = jax.random.normal(keys[0], (T, n_in), f32).astype(dtype)
    qw = random_weight(keys[1], L, n_out, n_in, fmt, block)
    norm = (1 + 0.2 * jax.random.normal(keys[2], (L, n_in), f32)).astype(dtype)
    b = jax.random.normal(keys[3], (L, n_out), f32).astype(dtype)
    res = jax.random.normal(keys[4], (T, n_out), f32).astype(dtype)
    kernel_kw = dict(plain={}, norm=dict(scale=norm, eps=1e-6), norm_bias=dict(scale=norm, eps=1e-5, b=b),
                     residual=dict(b=b, residual=res, epilogue="residual"),
                     swiglu=dict(scale=norm, eps=1e-6, epilogue="swiglu"))[kind]
    twin_kw = {k: (v[layer] if k in ("scale", "b") else v) for k, v in kernel_kw.items()}
    return x, qw, layer, kernel_kw, twin_kw


GEMV_SHAPES = [(100, 72, 32), (96, 200, 64)]   # (out, in, block_in)


@pytest.mark.parametrize("block", [None, (32, 64), (32, 16)], ids=["channel", "block", "tiles-of-blocks"])
@pytest.mark.parametrize("shape,fmt", [(0, "int8"), (1, "fp8")])
@pytest.mark.parametrize("kind", KINDS)
def test_gemv_8bit_matches_twin(kind, shape, fmt, block):
    """The second shape runs 2 output rows a program."""
    n_out, n_in, block_in = GEMV_SHAPES[shape]
    x, qw, layer, kw, twin_kw = case(kind, n_out, n_in, bf16, fmt, block, seed=hash((kind, shape, fmt)) % 2**31)
    rows = 2 if shape == 1 else 1
    y = fused_gemv(x, qw.values, layer, w_scale=qw.scale, w_block=block, block_in=block_in, rows=rows,
                   interpret=True, **kw)
    ref = twins.linear_8bit(x, qw[layer], **twin_kw)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert rel_err(y, ref) <= TOL[bf16]


@pytest.mark.parametrize("block", [None, (16, 32), (16, 8)], ids=["channel", "block", "tiles-of-4-blocks"])
def test_gemv_8bit_float32_is_exact_to_the_sum_order(block):
    """float32 x: every product of an 8-bit value and x is exact in float32, so the GEMV and its twin differ only in
    the order of float32 sums and where the scale multiplies."""
    x, qw, layer, kw, twin_kw = case("norm_bias", 96, 130, f32, "int8", block, seed=5)
    y = fused_gemv(x, qw.values, layer, w_scale=qw.scale, w_block=block, block_in=32, interpret=True, **kw)
    assert rel_err(y, twins.linear_8bit(x, qw[layer], **twin_kw)) <= TOL[f32]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_gemv_8bit_lm_head_float32_logits(fmt):
    x, qw, _, _, _ = case("plain", 200, 72, bf16, fmt, None, seed=9)
    w = qw[0]
    y = fused_gemv(x, w.values, w_scale=w.scale, block_in=64, out_dtype=f32, interpret=True)
    ref = twins.linear_8bit(x, w, out_dtype=f32)
    assert y.dtype == f32 and rel_err(y, ref) <= 1e-5


SKINNY_CONFIGS = [SkinnyConfig(32, 64, 4, 2, 1), SkinnyConfig(64, 32, 4, 2, 2)]   # split-K in the second


@pytest.mark.parametrize("block,config", [(None, 0), ((32, 64), 1)], ids=["channel", "block-split-k"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("kind", ["plain", "bias", "residual", "swiglu"])
def test_skinny_gemm_8bit_matches_twin(kind, fmt, block, config):
    """Batched decode rows (5 of them) on tensor cores, the 8-bit tiles converted to bf16 in registers."""
    base = dict(plain="plain", bias="norm_bias", residual="residual", swiglu="swiglu")[kind]
    x, qw, layer, kw, twin_kw = case(base, 100, 200, bf16, fmt, block, T=5, seed=hash((kind, fmt, config)) % 2**31)
    kw = {k: v for k, v in kw.items() if k not in ("scale", "eps")}        # the norm runs in XLA before this kernel
    twin_kw = {k: v for k, v in twin_kw.items() if k not in ("scale", "eps")}
    y = skinny_gemm(x, qw.values, layer, w_scale=qw.scale, w_block=block, config=SKINNY_CONFIGS[config],
                    interpret=True, **kw)
    ref = twins.linear_8bit(x, qw[layer], **twin_kw)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert rel_err(y, ref) <= TOL[bf16]


def test_8bit_weights_need_their_scales():
    x = jnp.ones((1, 64), bf16)
    v = jnp.ones((2, 32, 64), jnp.int8)
    with pytest.raises(ValueError, match="w_scale"):
        fused_gemv(x, v, 0, interpret=True)
    with pytest.raises(ValueError, match="w_scale"):
        fused_gemv(x, v, 0, w_scale=jnp.ones((2, 31)), interpret=True)
    with pytest.raises(ValueError, match="block_in"):
        fused_gemv(x, v, 0, w_scale=jnp.ones((2, 1, 2)), w_block=(32, 48), block_in=64, interpret=True)
    with pytest.raises(ValueError, match="w_scale"):
        skinny_gemm(jnp.ones((4, 64), bf16), v, 0, interpret=True)


# --- ops.pallas: every linear op routes a quantized weight to these kernels (or to the reference op) ---------------

OPS = get_ops("pallas-interpret")


@pytest.mark.parametrize("T", [1, 5], ids=["gemv", "skinny"])
@pytest.mark.parametrize("block", [None, (32, 64)], ids=["channel", "block"])
@pytest.mark.parametrize("op", ["linear", "rms_norm_linear", "rms_norm_swiglu", "linear_residual",
                                "linear_residual_norm_swiglu", "logits"])
def test_ops_route_quantized_weights(op, block, T):
    """Each op with a LayerWeight over a stacked QuantizedWeight (logits: a bare one), against the twin."""
    x, qw, layer, kw, _ = case("norm_bias", 96, 256, bf16, "int8", block, T=T, seed=hash((op, T)) % 2**31)
    lw = LayerWeight(qw, jnp.int32(layer))
    norm = LayerWeight(kw["scale"], jnp.int32(layer))
    b = LayerWeight(kw["b"], jnp.int32(layer))
    s, bl = kw["scale"][layer], kw["b"][layer]
    res = jax.random.normal(jax.random.PRNGKey(1), (T, 96), f32).astype(bf16)
    tw = twins.linear_8bit
    if op == "linear":
        got, ref = [OPS.linear(x, lw, b)], [tw(x, qw[layer], bl)]
    elif op == "rms_norm_linear":
        got, ref = [OPS.rms_norm_linear(x, norm, 1e-6, lw)], [tw(x, qw[layer], scale=s)]
    elif op == "rms_norm_swiglu":
        got, ref = [OPS.rms_norm_swiglu(x, norm, 1e-6, lw)], [tw(x, qw[layer], scale=s, epilogue="swiglu")]
    elif op == "linear_residual":
        got = [OPS.linear_residual(x, lw, None, res)]
        ref = [tw(x, qw[layer], residual=res, epilogue="residual")]
    elif op == "linear_residual_norm_swiglu":
        # o_proj [96, 1024] into the residual (at 5 rows a split-K product: its finish fused with the norm,
        # pallas/residual_norm.py), then the MLP's norm and a [2 x 48, 96] gate/up of its own
        x = jax.random.normal(jax.random.PRNGKey(5), (T, 1024), f32).astype(bf16)
        wo = random_weight(jax.random.PRNGKey(6), 3, 96, 1024, "int8", block)
        gu = random_weight(jax.random.PRNGKey(4), 3, 96, 96, "int8", block)
        nscale = LayerWeight(jnp.ones((3, 96), bf16), jnp.int32(layer))
        got = OPS.linear_residual_norm_swiglu(x, LayerWeight(wo, jnp.int32(layer)), None, res, nscale, 1e-6,
                                              LayerWeight(gu, jnp.int32(layer)))
        r = tw(x, wo[layer], residual=res, epilogue="residual")
        ref = [r, tw(r, gu[layer], scale=jnp.ones(96, bf16), epilogue="swiglu")]
    else:
        got, ref = [OPS.logits(x, qw[layer])], [tw(x, qw[layer], out_dtype=f32)]
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert rel_err(g, r) <= TOL[bf16]


def test_ops_send_prompt_rows_of_quantized_weights_to_the_reference_product(monkeypatch):
    """Rows past the batched-decode kernel's, W8A8 off: the reference op's XLA product (values converted, scale
    after)."""
    from jaxinfer.pallas import tables

    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", None)
    x, qw, layer, kw, _ = case("plain", 96, 256, bf16, "fp8", None, T=70, seed=2)
    got = OPS.linear(x, LayerWeight(qw, jnp.int32(layer)))
    assert rel_err(got, twins.linear_8bit(x, qw[layer])) <= TOL[bf16]


def test_ops_with_quantized_weights_keep_the_kernel_count():
    """A batch-1 projection with an 8-bit weight is one Pallas kernel, as with a bf16 one: nothing dequantized
    beside it."""
    x, qw, layer, kw, _ = case("norm", 96, 256, bf16, "int8", None, seed=3)
    f = lambda x, qw, s: OPS.rms_norm_linear(x, LayerWeight(s, jnp.int32(1)), 1e-6, LayerWeight(qw, jnp.int32(1)))
    kernels, eight_bit_reads = 0, 0

    def walk(jaxpr):
        nonlocal kernels, eight_bit_reads
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                kernels += 1
            elif "jaxpr" in eqn.params:   # a nested jit
                walk(eqn.params["jaxpr"].jaxpr)
            else:
                eight_bit_reads += any(getattr(v.aval, "dtype", None) == jnp.int8 for v in eqn.invars)

    walk(jax.make_jaxpr(f)(x, qw, kw["scale"]).jaxpr)
    assert kernels == 1 and eight_bit_reads == 0


def test_int8_conversions_agree_bit_for_bit():
    """The GEMV's two int8 -> float32 conversions (tables.GEMV_INT8_CONVERT): every int8 value exactly, and the same
    outputs."""
    from jaxinfer.pallas.fused_gemv import weights_to_f32

    v = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(np.asarray(weights_to_f32(v, "bits")), np.arange(-128, 128, dtype=np.float32))
    x, qw, layer, kw, _ = case("residual", 64, 96, bf16, "int8", None, seed=4)
    outs = [fused_gemv(x, qw.values, layer, w_scale=qw.scale, block_in=32, int8_convert=c, interpret=True, **kw)
            for c in ("bits", "cvt")]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))



def w8a8_twin(x, w: QuantizedWeight):
    """x quantized a row at a time to e4m3 (its max |x| onto 448), then the float32 product with the dequantized
    matrix."""
    xf = np.asarray(x.astype(f32))                                      # float32, as the product rounds x
    amax = np.maximum(np.abs(xf).max(axis=1, keepdims=True), np.float32(1e-30))
    xq = np.asarray(jnp.asarray(xf * (np.float32(448) / amax)).astype(jnp.float8_e4m3fn).astype(f32), np.float64)
    xq = xq * (amax / np.float32(448))
    return xq @ np.asarray(twins.dequantized(w), np.float64).T


def test_w8a8_product_matches_its_twin():
    from jaxinfer.ops.pallas import w8a8_product

    x, qw, layer, _, _ = case("plain", 96, 256, bf16, "fp8", None, T=20, seed=6)
    y = w8a8_product(x, qw[layer])
    assert y.dtype == f32
    assert rel_err(y, w8a8_twin(x, qw[layer])) <= 1e-5
    # against the unquantized activations: the e4m3 rounding of x (3 mantissa bits) and no more
    assert rel_err(y, twins.linear_8bit(x, qw[layer], out_dtype=f32)) <= 6e-2


def test_prompt_rows_of_fp8_weights_take_w8a8_from_the_tables_rows(monkeypatch):
    from jaxinfer.pallas import tables

    x, qw, layer, _, _ = case("plain", 96, 256, bf16, "fp8", None, T=70, seed=8)
    lw = LayerWeight(qw, jnp.int32(layer))
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", 64)
    jax.clear_caches()
    got = OPS.linear(x, lw)
    assert rel_err(got, w8a8_twin(x, qw[layer])) <= TOL[bf16]
    assert rel_err(got, twins.linear_8bit(x, qw[layer])) > 1e-3     # it did quantize the activations
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", 128)
    jax.clear_caches()
    assert rel_err(OPS.linear(x, lw), twins.linear_8bit(x, qw[layer])) <= TOL[bf16]


W8A8_CONFIGS = [SkinnyConfig(block_n=32, block_k=64, w8a8=True),
                SkinnyConfig(block_n=32, block_k=32, split_k=3, w8a8=True)]


@pytest.mark.parametrize("config", [0, 1], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("kind", ["plain", "bias", "residual", "swiglu"])
def test_skinny_gemm_w8a8_matches_xlas_w8a8(kind, fmt, config):
    """W8A8 in the batched-decode kernel (x's rows quantized to the weights' format, 8-bit tile products) against
    XLA's W8A8 product of the same quantized rows, with each epilogue rounded as the reference ops round."""
    from jaxinfer.ops.quantized import quantize_rows

    base = dict(plain="plain", bias="norm_bias", residual="residual", swiglu="swiglu")[kind]
    x, qw, layer, kw, twin_kw = case(base, 100, 200, bf16, fmt, None, T=5, seed=hash((kind, fmt, config)) % 2**31)
    kw = {k: v for k, v in kw.items() if k not in ("scale", "eps")}
    xq, x_scale = quantize_rows(x, qw.dtype)
    y = skinny_gemm(xq, qw.values, layer, w_scale=qw.scale, x_scale=x_scale, out_dtype=bf16,
                    config=W8A8_CONFIGS[config], interpret=True, **kw)
    p = xla_w8a8_product(x, qw[layer])
    if "b" in kw:
        p = p + kw["b"][layer].astype(f32)
    ref = p.astype(bf16)
    if kind == "residual":
        ref = kw["residual"] + ref
    elif kind == "swiglu":
        ref = reference.swiglu(ref)
    assert y.shape == ref.shape and y.dtype == bf16
    assert rel_err(y, ref) <= 1e-2
    # and it did quantize the activations: further from the product of the unquantized rows
    assert rel_err(y, twins.linear_8bit(x, qw[layer], **{k: v for k, v in twin_kw.items() if k not in ("scale", "eps")})) > 1e-3


def test_w8a8_int8_sums_are_exact():
    """int8 x int8 tile products summed in int32: the kernel's float32 result is XLA's s8 GEMM's bit for bit
    (one pass; the same two scale multiplications in the same order)."""
    from jaxinfer.ops.quantized import quantize_rows

    x, qw, layer, _, _ = case("plain", 64, 256, bf16, "int8", None, T=7, seed=14)
    xq, x_scale = quantize_rows(x, qw.dtype)
    got = skinny_gemm(xq, qw.values, layer, w_scale=qw.scale, x_scale=x_scale, out_dtype=f32,
                      config=W8A8_CONFIGS[0], interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(xla_w8a8_product(x, qw[layer])))


def test_w8a8_arguments_are_checked():
    from jaxinfer.ops.quantized import quantize_rows

    x, qw, layer, _, _ = case("plain", 64, 128, bf16, "fp8", None, T=4, seed=15)
    xq, xs = quantize_rows(x, qw.dtype)
    kw = dict(w_scale=qw.scale, interpret=True)
    with pytest.raises(ValueError, match="x_scale"):     # x not in the weights' format
        skinny_gemm(x, qw.values, layer, x_scale=xs, out_dtype=bf16, **kw)
    with pytest.raises(ValueError, match="x_scale"):     # one scale a row
        skinny_gemm(xq, qw.values, layer, x_scale=xs[:3], out_dtype=bf16, **kw)
    with pytest.raises(ValueError, match="out_dtype"):   # the output's dtype must be said
        skinny_gemm(xq, qw.values, layer, x_scale=xs, **kw)
    with pytest.raises(ValueError, match="out_dtype"):   # and is x's or float32 (unrounded sums) but in W8A8
        skinny_gemm(x, qw.values, layer, out_dtype=jnp.float16, **kw)
    assert skinny_gemm(x, qw.values, layer, out_dtype=f32, **kw).dtype == f32


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("op", ["linear", "rms_norm_linear", "linear_residual", "linear_residual_norm_swiglu"])
def test_batched_rows_take_w8a8_where_the_8bit_tables_row_says(monkeypatch, op, fmt):
    """A tables.SKINNY_GEMM_8BIT row with w8a8 set: the op quantizes x's rows and runs the kernel on 8-bit products
    (XLA's W8A8 product's result); without the row, the converted weight tiles (the twin's)."""
    from jaxinfer.pallas import tables

    x, qw, layer, _, _ = case("plain", 64, 96, bf16, fmt, None, T=5, seed=16)
    res = jax.random.normal(jax.random.PRNGKey(17), (5, 64), f32).astype(bf16)
    norm = jnp.ones((3, 96), bf16)
    gate_up = LayerWeight(random_weight(jax.random.PRNGKey(18), 3, 2 * 48, 64, fmt, None), jnp.int32(layer))
    lw = LayerWeight(qw, jnp.int32(layer))
    run = dict(linear=lambda: OPS.linear(x, lw),
               rms_norm_linear=lambda: OPS.rms_norm_linear(x, LayerWeight(norm, jnp.int32(layer)), 1e-6, lw),
               linear_residual=lambda: OPS.linear_residual(x, lw, None, res),
               linear_residual_norm_swiglu=lambda: OPS.linear_residual_norm_swiglu(
                   x, lw, None, res, LayerWeight(jnp.ones((3, 64), bf16), jnp.int32(layer)), 1e-6, gate_up)[0])[op]
    epilogue = "residual" if op.startswith("linear_residual") else "none"
    split = 2 if op == "linear_residual_norm_swiglu" else 1       # its split-K path: the partials' finish kernel
    xn = reference.rms_norm(x, norm[layer], 1e-6) if op == "rms_norm_linear" else x
    want = xla_w8a8_product(xn, qw[layer]).astype(bf16)
    want = res + want if epilogue == "residual" else want
    monkeypatch.setattr(tables, "SKINNY_GEMM_8BIT", {(64, 96, epilogue, 16): SkinnyConfig(32, 32, split_k=split,
                                                                                         w8a8=True)})
    jax.clear_caches()
    got = run()
    assert rel_err(got, want) <= 1e-2
    monkeypatch.setattr(tables, "SKINNY_GEMM_8BIT", {})
    jax.clear_caches()
    converted = run()
    assert rel_err(converted, got) > 1e-3      # the two paths differ by the activations' quantization


def test_a_w8a8_row_leaves_block_scaled_weights_converted(monkeypatch):
    """The 8-bit table is keyed by shape: block-scaled weights (the official FP8 checkpoints) at a shape whose row
    says W8A8 take that row's tiles converted, as the twin computes them."""
    from jaxinfer.pallas import tables

    x, qw, layer, _, _ = case("plain", 64, 96, bf16, "fp8", (32, 32), T=5, seed=20)
    monkeypatch.setattr(tables, "SKINNY_GEMM_8BIT", {(64, 96, "none", 16): SkinnyConfig(32, 32, w8a8=True)})
    jax.clear_caches()
    got = OPS.linear(x, LayerWeight(qw, jnp.int32(layer)))
    assert rel_err(got, twins.linear_8bit(x, qw[layer])) <= TOL[bf16]


# --- the Triton lowering for an H200 (tests/test_triton_lowering.py's way: on the CPU, the GPU stubbed in) ---------

@pytest.fixture
def h200(monkeypatch):
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))


def _lowers(fn, *args) -> bool:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return "custom_call @__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("fmt,block,convert", [("int8", None, "bits"), ("int8", None, "cvt"), ("int8", None, "prmt"),
                                               ("fp8", None, None),
                                               ("fp8", (128, 128), None), ("fp8", (128, 32), None)])
def test_8bit_kernels_lower_to_triton(h200, fmt, block, convert):
    x, qw, _, kw, _ = case("norm_bias", 256, 200, bf16, fmt, block, seed=10)   # ragged: masked tail tiles
    xm = jnp.ones((16, 200), bf16)
    assert _lowers(lambda x, v, s, n: fused_gemv(x, v, 1, w_scale=s, w_block=block, scale=n, block_in=128, rows=2,
                                                 int8_convert=convert), x, qw.values, qw.scale, kw["scale"])
    assert _lowers(lambda x, v, s: fused_gemv(x, v, 0, w_scale=s, w_block=block, block_in=128, epilogue="swiglu",
                                              int8_convert=convert, num_warps=2), x, qw.values, qw.scale)
    for cfg in SKINNY_CONFIGS:
        assert _lowers(lambda x, v, s: skinny_gemm(x, v, 1, w_scale=s, w_block=block, config=cfg, epilogue="swiglu"),
                       xm, qw.values, qw.scale)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_w8a8_kernels_lower_with_8bit_tile_products(h200, fmt):
    """W8A8's skinny kernel lowers for an H200 with its tile products in 8 bits: the e4m3 dot carries
    maxNumImpreciseAcc (fp8_dot.py; without it Triton upcasts both operands to float16) on a tile of 64 rows for 16
    (below wgmma's 64 Triton takes mma.sync, with no e4m3 form); the int8 one sums in i32 on the 16 rows. The
    converted-tiles kernel's bf16 dot carries no such attribute."""
    from bench.kernel_registers import triton_modules
    from jaxinfer.ops.quantized import quantize_rows

    x, qw, _, _, _ = case("plain", 256, 200, bf16, fmt, None, T=16, seed=19)
    cfg = SkinnyConfig(block_n=64, block_k=64, w8a8=True)
    xq, xs = quantize_rows(x, qw.dtype)
    [(_, w8a8)] = triton_modules(lambda x, v, s, xs: skinny_gemm(x, v, 1, w_scale=s, x_scale=xs, out_dtype=bf16,
                                                                 config=cfg, epilogue="swiglu"), (xq, qw.values, qw.scale, xs))
    dots = [line for line in w8a8.splitlines() if "tt.dot" in line]
    assert dots
    ty = {"int8": "i8", "fp8": "f8E4M3FN"}[fmt]
    rows = 64 if fmt == "fp8" else 16     # e4m3 tiles padded to wgmma's 64 rows (skinny_gemm.block_rows)
    assert all(f"tensor<{rows}x64x{ty}>" in d for d in dots), dots
    if fmt == "fp8":
        assert all("maxNumImpreciseAcc = 64" in d for d in dots), dots
    else:
        assert all("-> tensor<16x64xi32>" in d and "maxNumImpreciseAcc" not in d for d in dots), dots
    [(_, converted)] = triton_modules(lambda x, v, s: skinny_gemm(x, v, 1, w_scale=s, config=cfg), (x, qw.values, qw.scale))
    assert all("maxNumImpreciseAcc" not in line for line in converted.splitlines() if "tt.dot" in line)


def test_other_kernels_e4m3_dots_lower_as_before(h200):
    """fp8_dot.py changes only the kernels it registered (skinny_gemm's): another Pallas kernel's e4m3 dot in the same
    process carries no maxNumImpreciseAcc."""
    from jax.experimental import pallas as pl

    from bench.kernel_registers import triton_modules

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(x_ref[...], w_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=f32)

    fp8 = jnp.float8_e4m3fn
    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 64), f32), name="someone_elses_fp8_dot")
    [(_, text)] = triton_modules(call, (jnp.ones((64, 128), fp8), jnp.ones((64, 128), fp8)))
    dots = [line for line in text.splitlines() if "tt.dot" in line]
    assert dots and all("f8E4M3FN" in d and "maxNumImpreciseAcc" not in d for d in dots), dots


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_engine_steps_lower(h200, tmp_path, quantization):
    """Every compiled step of a small Qwen3 with weights quantized at load, through ops.pallas, lowers for an H200:
    the decode steps' GEMVs and the batched and prompt rows' products."""
    from bench.random_model import QWEN3_0_6B, write_random_model
    from jaxinfer.model.config import load_config
    from jaxinfer.model.transformer import split_layers
    from jaxinfer.model.weights import load_params
    from jaxinfer.runner.model_runner import ModelRunner
    from jaxinfer.settings import EngineConfig

    small = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 512, "max_position_embeddings": 1024}
    model = write_random_model(tmp_path / "m", {**QWEN3_0_6B, **small}, dtype="bfloat16")
    cfg = load_config(model, "bfloat16")
    params = split_layers(load_params(model, cfg, progress=False, quantization=quantization))
    config = EngineConfig.from_options(max_num_seqs=4, max_num_batched_tokens=64, unroll_layers=True,
                                       decode_steps=2).resolved("cpu", False)
    runner = ModelRunner(cfg, params, get_ops("pallas"), config, num_pages=33, max_model_len=256)
    calls = runner.bucket_calls()
    assert calls
    for variant, batch in calls:
        traced = runner.steps[variant].trace(runner.params, runner.kv, runner.state, batch)
        assert "custom_call @__gpu$xla.gpu.triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_batched_rows_pick_the_kernel_by_the_8bit_table_and_block_scales_always():
    """On the GPU (not interpret mode): per-channel 8-bit weights take the skinny kernel only where
    tables.SKINNY_GEMM_8BIT has the shape; block-scaled ones at every shape (XLA would dequantize the matrix)."""
    from jaxinfer.ops.pallas import _skinny_config
    from jaxinfer.pallas import tables

    x = jnp.ones((16, 256), bf16)
    channel = LayerWeight(random_weight(jax.random.PRNGKey(0), 2, 96, 256, "int8", None), jnp.int32(0))
    blocked = LayerWeight(random_weight(jax.random.PRNGKey(0), 2, 96, 256, "fp8", (128, 128)), jnp.int32(0))
    if (96, 256, "none", 16) not in tables.SKINNY_GEMM_8BIT:
        assert _skinny_config(x, channel, "none", interpret=False) is None
    assert _skinny_config(x, blocked, "none", interpret=False) is not None


def test_gemv_8bit_with_several_warps_a_program():
    """A tile spread over several warps (fused_gemv's num_warps; the sum crosses warps): the twin's outputs."""
    x, qw, layer, kw, twin_kw = case("swiglu", 96, 200, bf16, "int8", None, seed=12)
    y = fused_gemv(x, qw.values, layer, w_scale=qw.scale, block_in=64, num_warps=2, interpret=True, **kw)
    assert rel_err(y, twins.linear_8bit(x, qw[layer], **twin_kw)) <= TOL[bf16]
