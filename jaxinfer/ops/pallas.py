"""The op interface with Pallas GPU kernels swapped in, op by op, where they measured faster.

Ops not overridden here are the reference ops, and every fallback from a kernel to a reference op is chosen
here. The projections of a batch-1 decode step (T <= fused_gemv.MAX_T tokens) run as fused GEMVs
(pallas/fused_gemv.py): RMSNorm folded into the projection that follows it, the residual add and SwiGLU in the
epilogue, weights read in place from the stacked layer arrays. Batched decode rows (up to skinny_gemm.MAX_T) run
on tensor cores (pallas/skinny_gemm.py, residual and SwiGLU epilogues, the norm in XLA; a split-K output
projection's finish fused with the MLP's norm, pallas/residual_norm.py) at the shapes where its measured table
beat XLA (in interpret mode: always, so the CPU tests cover it). Prompt rows of the products in
tables.HOPPER_GEMM (Qwen3-4B's QKV and gate/up + SwiGLU) go to the Mosaic GPU wgmma GEMM with the epilogue
fused; other prompt rows to XLA's GEMM. Decode attention is the split-sequence kernel with the new token's
norm, RoPE and cache write folded in (pallas/decode_attention_rope.py); prompt attention the flash kernel of
pallas/prefill_attention.py. A step that is one fresh prompt runs its attention on the Mosaic GPU flash kernel
(pallas/hopper_attention.py) at the lengths of its measured table, else cuDNN's. A speculative verify step's
attention (Q rows a sequence) is the split-sequence kernel with the Q rows of a KV head's query heads in one tile
(pallas/verify_attention.py), the reference op where the tile would pass its limit.

A mixture of experts (moe_mlp, rms_norm_moe_mlp): at one token two routed GEMVs (pallas/moe_gemv.py) that route in the
kernel and read only the chosen experts' rows, the MLP norm folded into the router's GEMV and the gate/up one; more
rows the grouped GEMM over expert-sorted rows (pallas/grouped_gemm.py), routing and sorting in XLA.

8-bit weights (ops.quantized.QuantizedWeight, bare or in a LayerWeight) take the same kernels' 8-bit variants:
batch-1 decode the fused GEMV streaming 1-byte values (the same fusions, so no more kernels a layer), batched
decode rows the tensor-core kernel converting tiles in registers where tables.SKINNY_GEMM_8BIT has the shape (in
interpret mode always; block-scaled weights always); prompt rows of per-channel weights where
tables.HOPPER_GEMM_8BIT has the product the Mosaic GPU GEMM in W8A8 (x's rows quantized to the weights' format, 8-bit
wgmma, the scales in its epilogue); everything else (prompt rows, shapes not in the tables) XLA's product
(_xla_product): the values converted in the GEMM's fusion and the channel scales after (reference.quantized_product), block-scaled ones
dequantized to x's dtype first, int8 per-channel weights from tables.INT8_W8A8_ROWS rows on as W8A8 on int8 tensor
cores (int8_w8a8_product), and fp8 per-channel weights from tables.FP8_W8A8_ROWS rows on as W8A8 on fp8 tensor
cores (each row quantized to e4m3 with a scale of its own).

The INT8 KV cache (ops.quantized_cache.QuantizedCache as k_cache / v_cache) runs decode attention on the same kernels,
its values and scales as separate operands (_cache_operands): int8 tiles converted exactly in registers, a key's scale
on its column of scores, a value's on its probability, never a page dequantized; the fused kernel quantizes the new
token in place; a speculative verify step's attention takes the verify kernel the same way, and prompt rows are
quantized into it by the norm/RoPE/cache-write kernel. Prompt attention runs on the reference op.

Each kernel op takes `interpret` (Pallas interpret mode, for CPU tests) as a keyword; `make` binds it.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from jaxinfer.ops import LayerWeight, reference, weight
from jaxinfer.ops.quantized import FORMATS, MAX_VALUE, QuantizedWeight, format_of, quantize_rows
from jaxinfer.ops.quantized_cache import QuantizedCache
from jaxinfer.pallas import (decode_attention, decode_attention_rope, hopper_attention, hopper_gemm,
                             prefill_attention, residual_norm, rope_kv_write, skinny_gemm, tables)
from jaxinfer.pallas.expert_tiles import expert_tiles, gather_rows
from jaxinfer.pallas.fused_gemv import MAX_T, block_in_for, fused_gemv, int8_convert_for, rows_for, warps_for
from jaxinfer.pallas.grouped_gemm import choose_config as grouped_config, grouped_gemm, sorted_items
from jaxinfer.pallas.grouped_gemm import table_configs as grouped_table_configs
from jaxinfer.pallas.moe_gemv import routed_gemv
from jaxinfer.pallas.row_quantize import row_quantize
from jaxinfer.pallas.tables import HopperConfig
from jaxinfer.pallas.verify_attention import paged_verify_attention
from jaxinfer.pallas.verify_attention import supports as verify_supports


class OpSet(SimpleNamespace):
    """A namespace of ops, hashable by identity so that it can be a static argument of jax.jit."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


# --- weights as the kernels take them ---------------------------------------------------------------------------

def _stack_of(a) -> tuple[jax.Array, jax.Array | int]:
    """(the [L, ...] stack, its layer) of a per-layer parameter: a LayerWeight's, or a bare array as a one-layer
    stack."""
    return (a.stacked, a.layer) if isinstance(a, LayerWeight) else (a[None], 0)


def _stacked(w, *others):
    """(stacked weight, its layer, the others' layer, stacked others): per-layer parameters come stacked with a
    layer index (the vectors may have their own: model.split_layers splits the matrices and keeps the vectors
    stacked); plain arrays count as a one-layer stack."""
    vectors = [_stack_of(a) for a in others if a is not None]
    vector_layer = vectors[0][1] if vectors else 0
    others = tuple(None if a is None else _stack_of(a)[0] for a in others)
    stacked, layer = _stack_of(w)
    # None: the vectors share the matrix's layer (a scan's stacked layer, one traced index for both)
    return stacked, layer, None if vector_layer is layer else vector_layer, others


def _is_one_matrix(w) -> bool:
    """A plain matrix, or a one-layer stack (the split layers' matrices reach the ops so); not a layer of a deeper
    stack (a traced index)."""
    return w.stacked.shape[0] == 1 if isinstance(w, LayerWeight) else w.ndim == 2


def _one_matrix(w):
    """w as one [N, K] array (_is_one_matrix(w))."""
    return w.stacked[0] if isinstance(w, LayerWeight) else w


def _matrix(stacked) -> tuple[jax.Array, dict]:
    """(the array a kernel streams, the keywords that go with it): an 8-bit stack's values with w_scale and w_block;
    else the stack itself."""
    if isinstance(stacked, QuantizedWeight):
        return stacked.values, dict(w_scale=stacked.scale, w_block=stacked.block)
    return stacked, {}


def _quantized(w) -> bool:
    return isinstance(w.stacked if isinstance(w, LayerWeight) else w, QuantizedWeight)


def _xla_product(x, w) -> jax.Array:
    """x [T, in] @ the 8-bit w (a QuantizedWeight, or a LayerWeight holding one) in float32 [T, out], through XLA:
    W8A8 for fp8 per-channel weights from tables.FP8_W8A8_ROWS rows, else reference.quantized_product (block scales:
    the matrix dequantized to x's dtype first)."""
    q = _layer_matrix(w)
    rows = tables.FP8_W8A8_ROWS
    if q.block is None and q.dtype == jnp.float8_e4m3fn and rows is not None and x.shape[0] >= rows:
        return w8a8_product(x, q)
    rows = tables.INT8_W8A8_ROWS
    if q.block is None and q.dtype == jnp.int8 and rows is not None and x.shape[0] >= rows:
        return int8_w8a8_product(x, q)
    return reference.quantized_product(x, q)


def _layer_matrix(w):
    """The layer's [out, in] matrix of w (a LayerWeight, or bare): a one-layer stack's by a static index, which XLA
    makes a view (a traced index into a deeper stack is a copy of the layer, as in reference.linear)."""
    return _one_matrix(w) if _is_one_matrix(w) else weight(w)


def _w8a8(x, q, fmt: str, acc_dtype, name: str, precision=None) -> jax.Array:
    """XLA's W8A8 product for per-channel weights of format `fmt`: x's rows quantized (quantize_rows), the 8-bit
    product summed in acc_dtype, then times the row's and the output channel's scales, float32 [T, out]."""
    q = _layer_matrix(q)
    if q.block is not None or q.dtype != FORMATS[fmt]:
        raise ValueError(f"{name}: {fmt} weights with a scale per output channel, not {q.dtype} block {q.block}")
    xq, x_scale = quantize_rows(x, q.dtype)
    y = jax.lax.dot_general(xq, q.values, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=acc_dtype)
    return y.astype(jnp.float32) * x_scale[:, None] * q.scale


def w8a8_product(x, q, dot_dtype=jnp.float32, *, precise: bool = False) -> jax.Array:
    """x [T, in] @ q.T on fp8 tensor cores, float32 [T, out]; q: fp8 per-channel QuantizedWeight, or a LayerWeight
    holding one. Each row of x quantized to e4m3 with its own scale (its max |x| onto 448; the max taken in x's own
    dtype, exact, so that no float32 copy of x is written), the fp8 product summed in float32 and written in
    dot_dtype (bfloat16: the GEMM writes half the bytes, the sums rounded once more before the scales), then times
    the row's and the output channel's scales.

    On the GPU, XLA's fp8 GEMM at the default precision uses cuBLAS's fast accumulation (openxla/xla#6599: sums kept
    in the tensor cores' fewer bits, never promoted), as vLLM's fp8 GEMMs do; precise=True (HIGHEST) promotes them
    to float32 as our kernels do every k tile: the kernels' twin. The CPU sums in float32 either way."""
    return _w8a8(x, q, "fp8", dot_dtype, "w8a8_product", jax.lax.Precision.HIGHEST if precise else None)


def int8_w8a8_product(x, q) -> jax.Array:
    """x [T, in] @ q.T on int8 tensor cores, float32 [T, out]; q: int8 per-channel QuantizedWeight, or a LayerWeight
    holding one. Each row of x quantized to int8 with its own scale (its max |x| onto 127, rounded to nearest), the
    int8 products summed exactly in int32 (XLA's s8 GEMM: cuBLAS's IMMA on the GPU; |sum| <= in x 127^2 stays
    below 2^31 up to 133,000 columns), then times the row's and the output channel's scales in float32."""
    return _w8a8(x, q, "int8", jnp.int32, "int8_w8a8_product")


def xla_w8a8_product(x, q, *, precise: bool = False) -> jax.Array:
    """XLA's W8A8 product in q's format (int8_w8a8_product or w8a8_product). precise=True: fp8 sums promoted to
    float32 (w8a8_product's), the reference of the kernels' W8A8 tiles (skinny_gemm's and hopper_gemm's x_scale);
    int8 sums are exact either way."""
    if _layer_matrix(q).dtype == jnp.int8:
        return int8_w8a8_product(x, q)
    return w8a8_product(x, q, precise=precise)


def _xla_linear(x, w, b=None) -> jax.Array:
    """Rows no kernel takes: reference.linear, or for 8-bit weights _xla_product, rounded as reference.linear rounds."""
    if not _quantized(w):
        return reference.linear(x, w, b)
    y = _xla_product(x, w)
    return (y if b is None else y + weight(b).astype(jnp.float32)).astype(x.dtype)


def _norm_weights(q_norm, k_norm):
    """(q_norm stack, k_norm stack, their layer) of the per-head norms (None when the model has none)."""
    if q_norm is None:
        return None, None, None
    return q_norm.stacked, k_norm.stacked, q_norm.layer


# --- which kernel takes these rows ------------------------------------------------------------------------------

def _small(x) -> bool:
    """A batch-1 decode step's rows: the fused GEMV's."""
    return x.ndim == 2 and 0 < x.shape[0] <= MAX_T


def _skinny_config(x, w, epilogue, interpret):
    """The tensor-core kernel's config for a batched decode step's rows at a shape where its measured table beat
    XLA (in interpret mode at every shape, the table's row where it has one, so the CPU tests cover it); else None
    (XLA's GEMM). Block-scaled 8-bit weights take the kernel at every shape (choose_config where the table has
    none): XLA's product writes and re-reads a bf16 copy of the matrix, 5 bytes a weight against the kernel's 1. A
    row with w8a8 set runs W8A8 (_skinny_operands)."""
    if not (x.ndim == 2 and MAX_T < x.shape[0] <= skinny_gemm.MAX_T):
        return None
    n, k = (w.stacked if isinstance(w, LayerWeight) else w).shape[-2:]
    cfg = skinny_gemm.table_config(x.shape[0], n, k, epilogue, eight_bit=_quantized(w))
    if interpret:
        return cfg or skinny_gemm.choose_config(x.shape[0], n, k, epilogue)
    if cfg is None and _quantized(w) and (w.stacked if isinstance(w, LayerWeight) else w).block is not None:
        return skinny_gemm.choose_config(x.shape[0], n, k, epilogue)
    return cfg


def _hopper_config(x, w, epilogue, interpret):
    """The Mosaic GPU GEMM's config for prompt rows of one matrix where its measured table says it is the faster
    (on a Hopper GPU, or in interpret mode); else None. 8-bit weights with a scale per output channel: its W8A8
    table's."""
    if not (interpret or hopper_gemm.available()):
        return None
    if not (x.ndim == 2 and x.shape[0] > skinny_gemm.MAX_T and _is_one_matrix(w)):
        return None
    if not _quantized(w):
        return hopper_gemm.table_config(x.shape[0], *w.shape, epilogue)
    q = _one_matrix(w)
    if q.block is not None:         # block scales: XLA's product of the dequantized matrix
        return None
    return hopper_gemm.table_config(x.shape[0], *q.shape, epilogue, eight_bit=format_of(q.values.dtype))


# --- the kernels' calls -----------------------------------------------------------------------------------------

def _gemv(x, w, scale=None, b=None, *, interpret, **kw):
    stacked, layer, vector_layer, (scale, b) = _stacked(w, scale, b)
    values, quant = _matrix(stacked)
    n_out, n_in = values.shape[-2:]
    if kw.get("epilogue") == "swiglu":
        n_out //= 2
    return fused_gemv(x, values, layer, scale=scale, b=b,
                      block_in=block_in_for(n_out, n_in, values.dtype, quant.get("w_block")),
                      rows=rows_for(n_out, n_in, values.dtype), num_warps=warps_for(n_out, n_in, values.dtype),
                      int8_convert=int8_convert_for(n_out, n_in), vector_layer=vector_layer, interpret=interpret,
                      **quant, **kw)


def _w8a8_rows(x, dtype, interpret, norm=None) -> tuple[jax.Array, jax.Array]:
    """W8A8's activations: x's rows (or rms_norm(x) with norm = (scale, eps)) quantized to the 8-bit dtype, a float32
    scale each (quantize_rows' arithmetic). With tables.ROW_QUANTIZE_KERNEL, one kernel (pallas/row_quantize.py, the
    norm folded in) instead of XLA's norm and its two passes."""
    if tables.ROW_QUANTIZE_KERNEL:
        top = MAX_VALUE[format_of(dtype)]
        if norm is None:
            return row_quantize(x, dtype, top, interpret=interpret)
        (scale, eps), (scale_stack, layer) = norm, _stack_of(norm[0])
        return row_quantize(x, dtype, top, scale_stack, eps, layer, interpret=interpret)
    return quantize_rows(x if norm is None else reference.rms_norm(x, *norm), dtype)


def _normed(x, norm):
    """rms_norm(x) where norm = (scale, eps) is given, else x."""
    return x if norm is None else reference.rms_norm(x, *norm)


def _skinny_operands(x, stacked, config, interpret=False, norm=None):
    """(x, the matrix values, the skinny kernel's keywords for them) at a config: where the table's row says W8A8
    and the weights have a scale per output channel, x's rows quantized to the weights' 8-bit format, with their
    scales and the activations' dtype for the output (block-scaled weights of the same shape convert their tiles).
    norm = (scale, eps): x is the norm's input (folded into the quantization where there is one)."""
    values, quant = _matrix(stacked)
    if not config.w8a8 or quant.get("w_block") is not None:   # block scales: the row's tiles, converted
        return _normed(x, norm), values, quant
    xq, x_scale = _w8a8_rows(x, values.dtype, interpret, norm)
    return xq, values, dict(quant, x_scale=x_scale, out_dtype=x.dtype)


def _skinny(x, w, b=None, *, interpret, norm=None, **kw):
    stacked, layer, vector_layer, (b,) = _stacked(w, b)
    x, values, quant = _skinny_operands(x, stacked, kw["config"], interpret, norm)
    return skinny_gemm.skinny_gemm(x, values, layer, b=b, vector_layer=vector_layer, interpret=interpret, **quant,
                                   **kw)


def _hopper(x, w, config, residual=None, *, interpret, norm=None, **kw):
    """The Mosaic GPU GEMM on x (norm = (scale, eps): on rms_norm(x)) and one matrix; an 8-bit one in W8A8 (the
    rows quantized to its format)."""
    m = _one_matrix(w)
    if not isinstance(m, QuantizedWeight):
        return hopper_gemm.hopper_gemm(_normed(x, norm), m, residual=residual, config=config, interpret=interpret,
                                       **kw)
    xq, x_scale = _w8a8_rows(x, m.dtype, interpret, norm)
    return hopper_gemm.hopper_gemm(xq, m.values, residual=residual, config=config, interpret=interpret,
                                   x_scale=x_scale, w_scale=m.scale, out_dtype=x.dtype, **kw)


def _swiglu_of_normed(h, w_gate_up, *, interpret, norm=None):
    """silu(gate) * up of rows already normed (more than MAX_T of them); norm = (scale, eps): of rms_norm(h)."""
    if (cfg := _hopper_config(h, w_gate_up, "swiglu", interpret)) is not None:
        return _hopper(h, w_gate_up, cfg, epilogue="swiglu", interpret=interpret, norm=norm)
    if (cfg := _skinny_config(h, w_gate_up, "swiglu", interpret)) is not None:
        return _skinny(h, w_gate_up, epilogue="swiglu", config=cfg, interpret=interpret, norm=norm)
    return reference.swiglu(_xla_linear(_normed(h, norm), w_gate_up))


# --- the ops ----------------------------------------------------------------------------------------------------

def linear(x, w, b=None, *, interpret=False):
    if _small(x):
        return _gemv(x, w, b=b, interpret=interpret)
    if (cfg := _skinny_config(x, w, "none", interpret)) is not None:
        return _skinny(x, w, b, config=cfg, interpret=interpret)
    return _xla_linear(x, w, b)


def linear_out(x, w, b=None, *, interpret=False):
    """reference.linear_out: `linear`'s kernels (only a tensor-parallel op set tells the two apart)."""
    return linear(x, w, b, interpret=interpret)


def rms_norm_linear(x, scale, eps, w, b=None, *, interpret=False):
    if _small(x):
        return _gemv(x, w, scale=scale, eps=eps, b=b, interpret=interpret)
    if b is None and (cfg := _hopper_config(x, w, "none", interpret)) is not None:
        return _hopper(x, w, cfg, interpret=interpret, norm=(scale, eps))
    if (cfg := _skinny_config(x, w, "none", interpret)) is not None:
        return _skinny(x, w, b, config=cfg, interpret=interpret, norm=(scale, eps))
    return _xla_linear(reference.rms_norm(x, scale, eps), w, b)   # reference.rms_norm_linear


def rms_norm_swiglu(x, scale, eps, w_gate_up, *, interpret=False):
    if _small(x):
        return _gemv(x, w_gate_up, scale=scale, eps=eps, epilogue="swiglu", interpret=interpret)
    return _swiglu_of_normed(x, w_gate_up, interpret=interpret, norm=(scale, eps))


def linear_residual(x, w, b, residual, *, interpret=False):
    if _small(x):
        return _gemv(x, w, b=b, residual=residual, epilogue="residual", interpret=interpret)
    if b is None and (cfg := _hopper_config(x, w, "residual", interpret)) is not None:
        return _hopper(x, w, cfg, residual=residual, epilogue="residual", interpret=interpret)
    if (cfg := _skinny_config(x, w, "residual", interpret)) is not None:
        return _skinny(x, w, b, residual=residual, epilogue="residual", config=cfg, interpret=interpret)
    return residual + _xla_linear(x, w, b)   # reference.linear_residual


def linear_residual_norm_swiglu(x, w, b, residual, scale, eps, w_gate_up, *, interpret=False):
    """A batched decode step's split-K output projection: its finish (sum, round, residual) and the MLP's RMSNorm
    in one kernel (pallas/residual_norm.py) instead of two XLA kernels; elsewhere the two ops. With
    tables.ROW_QUANTIZE_KERNEL and the gate/up in W8A8, that kernel also quantizes the normed rows for it."""
    cfg = None
    if b is None and not _small(x) and x.shape[0] <= skinny_gemm.MAX_T:
        cfg = _skinny_config(x, w, "residual", interpret)
    if cfg is None or skinny_gemm.splits(cfg, x.shape[1]) == 1:
        r = linear_residual(x, w, b, residual, interpret=interpret)
        return r, rms_norm_swiglu(r, scale, eps, w_gate_up, interpret=interpret)
    stacked, layer, vector_layer, (scale_stack,) = _stacked(w, scale)
    xk, values, quant = _skinny_operands(x, stacked, cfg, interpret)
    partials = skinny_gemm.skinny_gemm(xk, values, layer, config=cfg, finish=False, interpret=interpret, **quant)
    norm = (partials, residual, scale_stack, eps, layer if vector_layer is None else vector_layer)
    gu_cfg = _skinny_config(residual, w_gate_up, "swiglu", interpret) if tables.ROW_QUANTIZE_KERNEL else None
    gu_stacked, gu_layer, _, _ = _stacked(w_gate_up)
    if gu_cfg is not None and gu_cfg.w8a8 and _quantized(w_gate_up) and gu_stacked.block is None:
        # the gate/up in W8A8: this kernel writes its rows quantized (no normed row, no quantization kernel)
        gu_values, gu_quant = _matrix(gu_stacked)
        top = MAX_VALUE[format_of(gu_values.dtype)]
        r, hq, h_scale = residual_norm.split_k_residual_rms_norm(*norm, quantize_to=(gu_values.dtype, top),
                                                                 interpret=interpret)
        return r, skinny_gemm.skinny_gemm(hq, gu_values, gu_layer, epilogue="swiglu", config=gu_cfg, x_scale=h_scale,
                                          out_dtype=residual.dtype, interpret=interpret, **gu_quant)
    r, h = residual_norm.split_k_residual_rms_norm(*norm, interpret=interpret)
    return r, _swiglu_of_normed(h, w_gate_up, interpret=interpret)


def logits(x, w, *, interpret=False):
    """The lm_head: at batch 1 the GEMV with float32 outputs (H200, Qwen3-4B's 778 MB matrix: 175 us a call
    against XLA's reduce fusions' 184); fp8 weights at the rows below tables.FP8_W8A8_ROWS the skinny kernel
    (_fp8_logits_rows); else XLA's float32 GEMM."""
    if _small(x):
        values, quant = _matrix(w[None])
        return fused_gemv(x, values, 0, block_in=block_in_for(*w.shape, w.dtype, quant.get("w_block")),
                          rows=rows_for(*w.shape, w.dtype), num_warps=warps_for(*w.shape, w.dtype),
                          int8_convert=int8_convert_for(*w.shape), out_dtype=jnp.float32, interpret=interpret, **quant)
    if _fp8_logits_rows(x, w):
        values, quant = _matrix(weight(w))
        return skinny_gemm.skinny_gemm(x, values, config=skinny_gemm.choose_config(x.shape[0], *values.shape),
                                       out_dtype=jnp.float32, interpret=interpret, **quant)
    return _xla_product(x, w) if _quantized(w) else reference.logits(x, w)


def _fp8_logits_rows(x, w) -> bool:
    """Whether the lm_head's rows take the skinny kernel: fp8 weights, 2 to FP8_W8A8_ROWS - 1 sampled rows (more
    are W8A8). XLA's converted product there is fused into its Triton GEMM (a byte a weight) only in steps that
    keep the fusions, and a prompt step of FP8_W8A8_ROWS token rows or more does not (runner/compiler_options.py):
    there it would write and read a bf16 copy of the matrix first (Qwen3-4B: 1.6 GB, ~0.5 ms on an H100). The kernel
    converts its tiles in registers in every step."""
    rows = tables.FP8_W8A8_ROWS
    return (rows is not None and _quantized(w) and weight(w).dtype == jnp.float8_e4m3fn
            and MAX_T < x.shape[0] < rows and x.shape[0] <= skinny_gemm.MAX_T)


def qkv_rope_write(qkv, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, layer, slot_mapping, num_heads,
                   num_kv_heads, with_kv=False, *, interpret=False):
    cos, sin = cos_sin if cos_sin is not None else (None, None)
    qn, kn, norm_layer = _norm_weights(q_norm, k_norm)
    k_values, v_values, scales = _cache_operands(k_cache, v_cache)
    q, *written = rope_kv_write.qkv_rope_write(qkv, cos, sin, qn, kn, k_values, v_values, layer, slot_mapping,
                                               num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
                                               interpret=interpret, norm_layer=norm_layer, with_kv=with_kv,
                                               tiled=tables.ROPE_KV_WRITE_TILE, **scales)
    kv = written[len(written) - 2:] if with_kv else []   # the k and v written, unrounded
    return q, *_caches_of(written[:len(written) - len(kv)]), *kv


def _cache_operands(k_cache, v_cache):
    """(k values, v values, the scales as the attention kernels' keywords) of plain caches or an INT8 cache."""
    if isinstance(k_cache, QuantizedCache):
        return k_cache.values, v_cache.values, {"k_scale": k_cache.scale, "v_scale": v_cache.scale}
    return k_cache, v_cache, {}


def _caches_of(written):
    """(k_cache, v_cache) of what a kernel wrote: (k, v), or an INT8 cache's (k values, v values, k scale, v scale)."""
    if len(written) == 4:
        return QuantizedCache(written[0], written[2]), QuantizedCache(written[1], written[3])
    return tuple(written)


def decode_qkv_attention(qkv, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, layer, slot_mapping, page_table,
                         context_lens, page_size, scale, num_heads, num_kv_heads, window=None, *, interpret=False):
    """The fused kernel where it takes the head dim; else the norm/RoPE/cache-write kernel, then decode attention."""
    hd = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    if not decode_attention_rope.supports(hd):
        q, k_cache, v_cache = qkv_rope_write(qkv, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, layer,
                                             slot_mapping, num_heads, num_kv_heads, interpret=interpret)
        return (paged_decode_attention(q, k_cache, v_cache, layer, page_table, context_lens, page_size, scale,
                                       window, interpret=interpret), k_cache, v_cache)
    cos, sin = cos_sin if cos_sin is not None else (None, None)
    qn, kn, norm_layer = _norm_weights(q_norm, k_norm)
    k_values, v_values, scales = _cache_operands(k_cache, v_cache)
    out, *written = decode_attention_rope.decode_attention_rope_write(
        qkv, cos, sin, qn, kn, k_values, v_values, layer, slot_mapping, page_table, context_lens,
        page_size=page_size, scale=float(scale), num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
        norm_layer=norm_layer, window=window, interpret=interpret, **scales)
    return out, *_caches_of(written)


def verify_attention(q, k_cache, v_cache, layer, page_table, context_lens, page_size, scale, window=None, *,
                     interpret=False):
    """Q query rows a sequence (a speculative verify step): the split-sequence kernel where its tile takes the Q x
    group rows and the head dim (verify_attention.supports: up to 128 rows), else the reference op."""
    _, Q, H, hd = q.shape
    if not verify_supports(Q * (H // k_cache.shape[1]), hd):
        return reference.verify_attention(q, k_cache, v_cache, layer, page_table, context_lens, page_size, scale,
                                          window=window)
    k_values, v_values, scales = _cache_operands(k_cache, v_cache)
    return paged_verify_attention(q, k_values, v_values, layer, page_table, context_lens, page_size, scale,
                                  window=window, interpret=interpret, **scales)


def paged_decode_attention(q, k_cache, v_cache, layer, page_table, context_lens, page_size, scale, window=None, *,
                           interpret=False):
    """The split-sequence kernel (pallas/decode_attention.py), an INT8 cache's scales as operands of their own."""
    k_values, v_values, scales = _cache_operands(k_cache, v_cache)
    return decode_attention.paged_decode_attention(q, k_values, v_values, layer, page_table, context_lens, page_size,
                                                   scale, window=window, interpret=interpret, **scales)


def paged_attention(q, k_cache, v_cache, layer, page_table, token_seq, positions, page_size, scale, window=None,
                    *, interpret=False):
    """The prefill kernel (pallas/prefill_attention.py); with the INT8 cache the reference op (the prefill kernel does
    not take int8 pages yet)."""
    if isinstance(k_cache, QuantizedCache):
        return reference.paged_attention(q, k_cache, v_cache, layer, page_table, token_seq, positions, page_size,
                                         scale, window=window)
    return prefill_attention.paged_attention(q, k_cache, v_cache, layer, page_table, token_seq, positions, page_size,
                                             scale, window=window, interpret=interpret)


def fresh_prompt_attention(q, k, v, scale, window=None, *, interpret=False):
    """A step that is one fresh prompt (EngineConfig.fresh_prompt_attention): the Mosaic GPU flash attention at the
    lengths of its measured table (on a Hopper GPU, or in interpret mode), else cuDNN's flash attention on GPUs
    (16-bit only; XLA's attention otherwise)."""
    if window is not None:
        return reference.fresh_prompt_attention(q, k, v, scale, window=window)
    config = hopper_attention.table_config(q, k) if interpret or hopper_gemm.available() else None
    if config is not None:
        return hopper_attention.fresh_prompt_flash(q, k, v, scale, config=config, interpret=interpret)
    return reference.fresh_prompt_attention(q, k, v, scale, implementation=_one_sequence_implementation(q, interpret))


def prefixed_chunk_attention(q, k_cache, v_cache, layer, page_row, prefix_len, slot_mapping, page_size, scale,
                             window=None, *, interpret=False):
    """A step that is one sequence's chunk after a cached prefix (EngineConfig.prefixed_chunk_attention): two cuDNN
    flash attentions merged by their log-sum-exps on GPUs (16-bit only; XLA's otherwise)."""
    return reference.prefixed_chunk_attention(q, k_cache, v_cache, layer, page_row, prefix_len, slot_mapping,
                                              page_size, scale, implementation=_one_sequence_implementation(q, interpret),
                                              window=window)


def _one_sequence_implementation(q, interpret) -> str:
    """cuDNN for 16-bit queries where it runs (not in interpret mode), else XLA's attention."""
    cudnn = not interpret and q.dtype in (jnp.bfloat16, jnp.float16) and cudnn_flash_attention_available()
    return "cudnn" if cudnn else "xla"


@functools.cache
def cudnn_flash_attention_available() -> bool:
    """cuDNN's flash attention runs on NVIDIA GPUs from Ampere (compute capability 8.0) on; elsewhere the
    one-sequence attentions fall back to XLA's (correct, slower) instead of failing at start-up."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    try:
        return device.platform == "gpu" and capability is not None and float(capability) >= 8.0
    except ValueError:
        return False


def _routed_block(x, logits, w_gate_up, w_down, top_k, renormalize, residual, interpret, scale=None, eps=1e-6):
    """One token's block after the router: the gate/up routed GEMV (the norm as its prologue with `scale`) routes and
    writes its routes, the combine takes them; 8-bit stacks pass their values and channel scales."""
    gate_up, layer, vector_layer, (scale_stack,) = _stacked(w_gate_up, scale)
    down, down_layer, _, _ = _stacked(w_down)
    (gate_up, gu_kw), (down, dn_kw) = _matrix(gate_up), _matrix(down)
    route = dict(top_k=top_k, renormalize=renormalize, interpret=interpret)
    h, routes = routed_gemv(x, logits, gate_up, layer, epilogue="swiglu", scale=scale_stack, eps=eps,
                            vector_layer=vector_layer, emit_routes=True, **gu_kw, **route)
    return routed_gemv(h, None, down, down_layer, epilogue="combine", residual=residual, routes=routes, **dn_kw,
                       **route)


def _grouped_w8a8(rows: int, *quants: dict) -> bool:
    """Whether the grouped GEMMs of `rows` expert assignments run W8A8 (tables.GROUPED_W8A8_ROWS): 8-bit experts
    with a scale per output channel (_matrix's keywords of each stack)."""
    threshold = tables.GROUPED_W8A8_ROWS
    return (threshold is not None and rows >= threshold
            and all(q.get("w_scale") is not None and q.get("w_block") is None for q in quants))


def _grouped_hopper_configs(assignments: int, gate_up, down, gu_kw: dict, dn_kw: dict, interpret: bool):
    """(gate/up's, down's) configs of the grouped Mosaic GEMM where tables.HOPPER_GROUPED_GEMM has both products at
    this many assignments with one row tile (one padded layout for both), bf16 experts on Hopper; else None."""
    if gu_kw or dn_kw or gate_up.dtype != jnp.bfloat16 or not (interpret or hopper_gemm.available()):
        return None
    E, two_i, D = gate_up.shape[1:]
    up = hopper_gemm.grouped_table_config(assignments, E, two_i, D, "swiglu")
    dn = hopper_gemm.grouped_table_config(assignments, E, D, two_i // 2, "none")
    if up is None or dn is None or hopper_gemm.cta_tile(up)[0] != hopper_gemm.cta_tile(dn)[0]:
        return None
    return up, dn


def _moe_on_hopper(x, experts, gate_up, layer, down, down_layer, top_k: int, cfg_up: HopperConfig,
                   cfg_down: HopperConfig, interpret: bool) -> jax.Array:
    """Each assignment's expert output [T, top_k, D] through the grouped Mosaic GEMM: the rows in the padded
    layout of pallas/expert_tiles.py, gate/up + SwiGLU then down on each tile's expert, read in place from the [L,
    E, N, K] stacks as [L * E, N, K] (a reshape, no copy; group layer * E + expert)."""
    E = gate_up.shape[1]
    tiles = expert_tiles(*reference.sort_by_expert(experts, E), hopper_gemm.cta_tile(cfg_up)[0])

    def groups(stack_layer):   # each tile's matrix in the [L * E] view of a stack read at stack_layer
        return jnp.where(tiles.tile_expert >= 0, stack_layer * E + tiles.tile_expert, -1).astype(jnp.int32)

    h = hopper_gemm.hopper_gemm(gather_rows(x, tiles, top_k), gate_up.reshape(-1, *gate_up.shape[2:]),
                                epilogue="swiglu", row_tile_group=groups(layer), config=cfg_up, interpret=interpret)
    y = hopper_gemm.hopper_gemm(h, down.reshape(-1, *down.shape[2:]), row_tile_group=groups(down_layer),
                                config=cfg_down, interpret=interpret)
    return y[tiles.position].reshape(x.shape[0], top_k, -1)


def moe_mlp(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, top_k: int, renormalize: bool,
            residual: jax.Array | None = None, *, interpret: bool = False) -> jax.Array:
    """A mixture of experts, weights read in place from the layer's [E, N, K] expert stacks; the router's product
    is `linear` (the GEMV at batch 1). One token (a batch-1 decode step): two routed GEMVs (pallas/moe_gemv.py),
    the first routing from the logits and reading only the chosen experts' matrices, the second taking its routes and
    summing the experts' outputs into the residual. More rows: softmax and top-k in XLA, the assignments sorted by
    expert (reference.sort_by_expert) through the grouped GEMM (pallas/grouped_gemm.py, each expert's rows in tiles;
    on Hopper, where tables.HOPPER_GROUPED_GEMM has both products, the grouped Mosaic GPU GEMM), each expert's
    output weighted and summed in float32 as reference.moe_mlp. 8-bit experts (QuantizedWeight stacks): both kernels
    read their values and scales; from tables.GROUPED_W8A8_ROWS assignments on, per-channel ones in W8A8 (each row
    of x, and of the SwiGLU's output, quantized to the experts' format)."""
    T = x.shape[0]
    logits = linear(x, router, interpret=interpret)
    if T == 1:
        return _routed_block(x, logits, w_gate_up, w_down, top_k, renormalize, residual, interpret)
    gate_up, layer, _, _ = _stacked(w_gate_up)
    down, down_layer, _, _ = _stacked(w_down)
    (gate_up, gu_kw), (down, dn_kw) = _matrix(gate_up), _matrix(down)
    weights, experts = reference.route(logits, top_k, renormalize)
    if (cfgs := _grouped_hopper_configs(T * top_k, gate_up, down, gu_kw, dn_kw, interpret)) is not None:
        y = _moe_on_hopper(x, experts, gate_up, layer, down, down_layer, top_k, *cfgs, interpret)
    else:
        y = _moe_on_triton(x, experts, gate_up, layer, gu_kw, down, down_layer, dn_kw, top_k, interpret)
    out = jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1).astype(x.dtype)
    return out if residual is None else residual + out


def _moe_on_triton(x, experts, gate_up, layer, gu_kw: dict, down, down_layer, dn_kw: dict, top_k: int,
                   interpret: bool) -> jax.Array:
    """Each assignment's expert output [T, top_k, D] through the Triton grouped GEMM (pallas/grouped_gemm.py) over
    the expert-sorted rows, in W8A8 where _grouped_w8a8 says."""
    T, D = x.shape
    E, two_i, _ = gate_up.shape[1:]
    order, group_sizes = reference.sort_by_expert(experts, E)
    cfgs = grouped_table_configs(T * top_k, E, two_i, D) if not (gu_kw or dn_kw) else None   # bf16 experts' rows
    if cfgs is None:
        per_group = T * top_k / E
        cfgs = grouped_config(per_group, two_i, D, "swiglu"), grouped_config(per_group, D, two_i // 2)
        cfgs = cfgs[0], dataclasses.replace(cfgs[1], block_m=cfgs[0].block_m)   # one schedule for both products
    cfg_up, cfg_down = cfgs
    items = sorted_items(group_sizes, T * top_k, cfg_up.block_m)
    rows = order // top_k
    if _grouped_w8a8(T * top_k, gu_kw, dn_kw):   # x's rows quantized once, then gathered with their scales
        xq, x_scale = _w8a8_rows(x, gate_up.dtype, interpret)
        h = grouped_gemm(xq[rows], gate_up, items, layer, epilogue="swiglu", config=cfg_up, interpret=interpret,
                         x_scale=x_scale[rows], out_dtype=x.dtype, **gu_kw)
        hq, h_scale = _w8a8_rows(h, down.dtype, interpret)
        y = grouped_gemm(hq, down, items, down_layer, config=cfg_down, interpret=interpret, x_scale=h_scale,
                         out_dtype=x.dtype, **dn_kw)
    else:
        h = grouped_gemm(x[rows], gate_up, items, layer, epilogue="swiglu", config=cfg_up, interpret=interpret,
                         **gu_kw)
        y = grouped_gemm(h, down, items, down_layer, config=cfg_down, interpret=interpret, **dn_kw)
    return jnp.zeros_like(y).at[order].set(y).reshape(T, top_k, D)


def rms_norm_moe_mlp(x: jax.Array, scale: jax.Array, eps: float, router: jax.Array, w_gate_up: jax.Array,
                     w_down: jax.Array, top_k: int, renormalize: bool, residual: bool = True, *,
                     interpret: bool = False) -> jax.Array:
    """x + the mixture of experts of rms_norm(x) (residual=False: the mixture alone, reference.rms_norm_moe_mlp).
    One token: the norm is the prologue of the router's GEMV and of the gate/up routed GEMV (no kernel of its own),
    so that the block is three kernels; the gate/up kernel routes and writes its routes for the combine. More rows:
    the norm in XLA, then moe_mlp."""
    if x.shape[0] != 1:
        return moe_mlp(reference.rms_norm(x, scale, eps), router, w_gate_up, w_down, top_k, renormalize,
                       residual=x if residual else None, interpret=interpret)
    logits = rms_norm_linear(x, scale, eps, router, interpret=interpret)
    return _routed_block(x, logits, w_gate_up, w_down, top_k, renormalize, x if residual else None, interpret,
                         scale=scale, eps=eps)


# The ops this module overrides, each bound to `interpret` by `make`.
KERNEL_OPS = (linear, linear_out, rms_norm_linear, rms_norm_swiglu, linear_residual, linear_residual_norm_swiglu,
              logits, qkv_rope_write, decode_qkv_attention, fresh_prompt_attention, prefixed_chunk_attention,
              paged_decode_attention, paged_attention, verify_attention, moe_mlp, rms_norm_moe_mlp)


def make(interpret: bool = False) -> OpSet:
    """The reference ops with KERNEL_OPS in their place; `interpret`: the kernels in Pallas interpret mode."""
    ops = {name: getattr(reference, name) for name in dir(reference) if not name.startswith("_")}
    ops.update({op.__name__: functools.partial(op, interpret=interpret) for op in KERNEL_OPS})
    return OpSet(**ops, name="pallas-interpret" if interpret else "pallas")
