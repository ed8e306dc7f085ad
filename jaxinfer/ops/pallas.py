"""The op interface with Pallas GPU kernels swapped in, op by op, where they measured faster.

Ops not overridden here are the reference ops. The projections of a batch-1 decode step (T <= MAX_T
tokens) run as fused GEMVs (pallas/fused_gemv.py): RMSNorm folded into the projection that follows
it, the residual add and SwiGLU in the epilogue, weights read in place from the stacked layer
arrays. Batched decode rows (up to skinny_gemm.MAX_T) run on tensor cores (pallas/skinny_gemm.py,
residual and SwiGLU epilogues, the norm in XLA; a split-K output projection's finish fused with the MLP's
norm, pallas/residual_norm.py) at the shapes where its measured table beat XLA
(in interpret mode: always, so the CPU tests cover it); prompt rows go to the same kernel tiled over
rows where its prefill table has the shape (empty until measured), else to XLA's GEMM. Prompt rows of the
products in pallas/hopper_gemm.py's measured table (Qwen3-4B's QKV and gate/up + SwiGLU) go to the Mosaic GPU
wgmma GEMM with the epilogue fused, ahead of both. Decode attention is
the split-sequence kernel of pallas/decode_attention.py. A step that is one fresh prompt runs its attention on
the Mosaic GPU flash kernel (pallas/hopper_attention.py) at the lengths of its measured table, else cuDNN's.
`get_ops("pallas-interpret")` runs the same kernels in Pallas interpret mode, for CPU tests.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from jaxinfer.ops import LayerWeight, reference


class OpSet(SimpleNamespace):
    """A namespace of ops, hashable by identity so that it can be a static argument of jax.jit."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def make(interpret: bool = False, flash_prefill: bool = True, fused_decode_rope: bool = True) -> OpSet:
    """flash_prefill: the Pallas flash prefill attention (H200: 1.2x XLA's attention path end to end
    at 1k tokens, 3.6x at 8k, 7.5x at 32k); off gives the reference attention, for A/B runs.
    fused_decode_rope: a decode step's norm/RoPE/cache write inside the decode attention kernel
    (pallas/decode_attention_rope.py; one kernel fewer per layer: H200, Qwen3-4B batch 1, 2.725 ->
    2.695 ms a step; off gives rope_kv_write then decode attention, for A/B runs).
    (Gate/up rows interleaved for the SwiGLU GEMV measured no faster on the H200 and were removed: bench/NOTES.md,
    sixteenth session.)"""
    from jaxinfer.pallas import (decode_attention, decode_attention_rope, hopper_attention, hopper_gemm,
                                 prefill_attention, residual_norm, rope_kv_write, skinny_gemm)
    from jaxinfer.pallas.fused_gemv import MAX_T, block_in_for, fused_gemv, rows_for

    def _stacked(w, *others):
        """(stacked weight, its layer, the others' layer, stacked others): per-layer parameters come
        stacked with a layer index (the vectors may have their own: model.split_layers splits the
        matrices and keeps the vectors stacked); plain arrays count as a one-layer stack."""
        vectors = [a for a in others if a is not None]
        vector_layer = vectors[0].layer if vectors and isinstance(vectors[0], LayerWeight) else 0
        others = tuple(None if a is None else a.stacked if isinstance(a, LayerWeight) else a[None] for a in others)
        stacked, layer = (w.stacked, w.layer) if isinstance(w, LayerWeight) else (w[None], 0)
        # None: the vectors share the matrix's layer (a scan's stacked layer, one traced index for both)
        return stacked, layer, None if vector_layer is layer else vector_layer, others

    def _gemv(x, w, scale=None, b=None, **kw):
        stacked, layer, vector_layer, (scale, b) = _stacked(w, scale, b)
        n_out, n_in = stacked.shape[-2:]
        if kw.get("epilogue") == "swiglu":
            n_out //= 2
        return fused_gemv(x, stacked, layer, scale=scale, b=b, block_in=block_in_for(n_out, n_in, stacked.dtype),
                          rows=rows_for(n_out, n_in), vector_layer=vector_layer, interpret=interpret, **kw)

    def _skinny(x, w, b=None, **kw):
        stacked, layer, vector_layer, (b,) = _stacked(w, b)
        return skinny_gemm.skinny_gemm(x, stacked, layer, b=b, vector_layer=vector_layer, interpret=interpret, **kw)

    def small(x) -> bool:
        return x.ndim == 2 and 0 < x.shape[0] <= MAX_T

    def skinny_config(x, w, epilogue="none"):
        """The tensor-core kernel's config for these rows (a batched decode step's, or a prompt's: then
        in row tiles), at a shape where its measured tables beat XLA (in interpret mode at every
        shape, so the CPU tests cover it); else None (XLA's GEMM)."""
        if not (x.ndim == 2 and x.shape[0] > MAX_T):
            return None
        n, k = (w.stacked if isinstance(w, LayerWeight) else w).shape[-2:]
        if interpret:
            return skinny_gemm.choose_config(x.shape[0], n, k, epilogue)
        table = skinny_gemm.table_config if x.shape[0] <= skinny_gemm.MAX_T else skinny_gemm.prefill_table_config
        return table(x.shape[0], n, k, epilogue)

    def is_one_matrix(w) -> bool:
        """A plain matrix, or a one-layer stack (the split layers' matrices reach the ops so); not a layer of a
        deeper stack (a traced index)."""
        return w.stacked.shape[0] == 1 if isinstance(w, LayerWeight) else w.ndim == 2

    def one_matrix(w):
        """w as one [N, K] array (is_one_matrix(w))."""
        return w.stacked[0] if isinstance(w, LayerWeight) else w

    def hopper_config(x, w, epilogue="none"):
        """The Mosaic GPU GEMM's config for these rows of one matrix where its measured tables say it is the
        faster (on a Hopper GPU, or in interpret mode): prompt rows (hopper_gemm.PREFILL_TABLE) or a decode
        batch's (hopper_gemm.DECODE_TABLE); else None."""
        if not (interpret or hopper_gemm.available()):
            return None
        if not (x.ndim == 2 and x.shape[0] > MAX_T and is_one_matrix(w)):
            return None
        if x.shape[0] <= skinny_gemm.MAX_T:
            return hopper_gemm.decode_config(*w.shape, epilogue) if x.shape[0] <= hopper_gemm.DECODE_ROWS else None
        return hopper_gemm.table_config(x.shape[0], *w.shape, epilogue)

    def _hopper(x, w, config, residual=None, **kw):
        """A decode batch's rows padded to the kernel's row tile (their outputs sliced off after: rows are
        independent), prompt rows as they are."""
        M = x.shape[0]
        pad = -M % hopper_gemm.cta_tile(config)[0] if M <= skinny_gemm.MAX_T else 0
        if pad:
            x = jnp.pad(x, ((0, pad), (0, 0)))
            residual = None if residual is None else jnp.pad(residual, ((0, pad), (0, 0)))
        y = hopper_gemm.hopper_gemm(x, one_matrix(w), residual=residual, config=config, interpret=interpret, **kw)
        return y[:M] if pad else y

    def linear(x, w, b=None):
        if small(x):
            return _gemv(x, w, b=b)
        if (cfg := skinny_config(x, w)) is not None:
            return _skinny(x, w, b, config=cfg)
        return reference.linear(x, w, b)

    def rms_norm_linear(x, scale, eps, w, b=None):
        if small(x):
            return _gemv(x, w, scale=scale, eps=eps, b=b)
        if b is None and (cfg := hopper_config(x, w)) is not None:
            return _hopper(reference.rms_norm(x, scale, eps), w, cfg)
        if (cfg := skinny_config(x, w)) is not None:
            return _skinny(reference.rms_norm(x, scale, eps), w, b, config=cfg)
        return reference.rms_norm_linear(x, scale, eps, w, b)

    def rms_norm_swiglu(x, scale, eps, w_gate_up):
        if small(x):
            return _gemv(x, w_gate_up, scale=scale, eps=eps, epilogue="swiglu")
        return _swiglu_of_normed(reference.rms_norm(x, scale, eps), w_gate_up)

    def _swiglu_of_normed(h, w_gate_up):
        """silu(gate) * up of rows already normed (more than MAX_T of them)."""
        if (cfg := hopper_config(h, w_gate_up, "swiglu")) is not None:
            return _hopper(h, w_gate_up, cfg, epilogue="swiglu")
        if (cfg := skinny_config(h, w_gate_up, "swiglu")) is not None:
            return _skinny(h, w_gate_up, epilogue="swiglu", config=cfg)
        return reference.swiglu(reference.linear(h, w_gate_up))

    def linear_residual_norm_swiglu(x, w, b, residual, scale, eps, w_gate_up):
        """A batched decode step's split-K output projection: its finish (sum, round, residual) and the MLP's
        RMSNorm in one kernel (pallas/residual_norm.py) instead of two XLA kernels; elsewhere the two ops."""
        cfg = None
        if b is None and not small(x) and x.shape[0] <= skinny_gemm.MAX_T and hopper_config(x, w, "residual") is None:
            cfg = skinny_config(x, w, "residual")
        if cfg is None or skinny_gemm.splits(cfg, x.shape[1]) == 1:
            r = linear_residual(x, w, b, residual)
            return r, rms_norm_swiglu(r, scale, eps, w_gate_up)
        stacked, layer, vector_layer, (scale_stack,) = _stacked(w, scale)
        partials = skinny_gemm.skinny_gemm(x, stacked, layer, config=cfg, finish=False, interpret=interpret)
        r, h = residual_norm.split_k_residual_rms_norm(partials, residual, scale_stack, eps,
                                                       layer if vector_layer is None else vector_layer,
                                                       interpret=interpret)
        return r, _swiglu_of_normed(h, w_gate_up)

    def logits(x, w):
        """The lm_head: at batch 1 the GEMV with float32 outputs (H200, Qwen3-4B's 778 MB matrix: 175 us a
        call against XLA's reduce fusions' 184); else XLA's float32 GEMM."""
        if small(x):
            return fused_gemv(x, w[None], 0, block_in=block_in_for(*w.shape, w.dtype), out_dtype=jnp.float32,
                              interpret=interpret)
        return reference.logits(x, w)

    def linear_residual(x, w, b, residual):
        if small(x):
            return _gemv(x, w, b=b, residual=residual, epilogue="residual")
        if b is None and (cfg := hopper_config(x, w, "residual")) is not None:
            return _hopper(x, w, cfg, residual=residual, epilogue="residual")
        if (cfg := skinny_config(x, w, "residual")) is not None:
            return _skinny(x, w, b, residual=residual, epilogue="residual", config=cfg)
        return reference.linear_residual(x, w, b, residual)

    def qkv_rope_write(qkv, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, layer, slot_mapping, num_heads,
                       num_kv_heads, with_kv=False):
        cos, sin = cos_sin if cos_sin is not None else (None, None)
        qn, kn = (None, None) if q_norm is None else (q_norm.stacked, k_norm.stacked)
        return rope_kv_write.qkv_rope_write(qkv, cos, sin, qn, kn, k_cache, v_cache, layer, slot_mapping,
                                            num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
                                            interpret=interpret, norm_layer=None if q_norm is None else q_norm.layer,
                                            with_kv=with_kv, tiled=rope_kv_write.TILED)

    def decode_qkv_attention(qkv, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, layer, slot_mapping, page_table,
                             context_lens, page_size, scale, num_heads, num_kv_heads):
        hd = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        if not (fused_decode_rope and decode_attention_rope.supports(hd)):
            q, k_cache, v_cache = qkv_rope_write(qkv, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, layer,
                                                 slot_mapping, num_heads, num_kv_heads)
            return (decode_attention.paged_decode_attention(q, k_cache, v_cache, layer, page_table, context_lens,
                                                            page_size, scale, interpret=interpret), k_cache, v_cache)
        cos, sin = cos_sin if cos_sin is not None else (None, None)
        qn, kn = (None, None) if q_norm is None else (q_norm.stacked, k_norm.stacked)
        return decode_attention_rope.decode_attention_rope_write(
            qkv, cos, sin, qn, kn, k_cache, v_cache, layer, slot_mapping, page_table, context_lens,
            page_size=page_size, scale=float(scale), num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
            norm_layer=None if q_norm is None else q_norm.layer, interpret=interpret)

    ops = {name: getattr(reference, name) for name in dir(reference) if not name.startswith("_")}
    ops.update(linear=linear, rms_norm_linear=rms_norm_linear, rms_norm_swiglu=rms_norm_swiglu,
               linear_residual=linear_residual, linear_residual_norm_swiglu=linear_residual_norm_swiglu, logits=logits,
               qkv_rope_write=qkv_rope_write, decode_qkv_attention=decode_qkv_attention,
               paged_decode_attention=functools.partial(decode_attention.paged_decode_attention,
                                                        interpret=interpret))
    if flash_prefill:
        ops["paged_attention"] = functools.partial(prefill_attention.paged_attention, interpret=interpret)

    def fresh_prompt_attention(q, k, v, scale):
        """A step that is one fresh prompt (EngineConfig.fresh_prompt_attention): the Mosaic GPU flash attention
        at the lengths of its measured table (on a Hopper GPU, or in interpret mode), else cuDNN's flash
        attention on GPUs (16-bit only; XLA's attention otherwise)."""
        config = hopper_attention.table_config(q, k) if interpret or hopper_gemm.available() else None
        if config is not None:
            return hopper_attention.fresh_prompt_flash(q, k, v, scale, config=config, interpret=interpret)
        return reference.fresh_prompt_attention(q, k, v, scale, implementation=one_sequence_implementation(q))

    def prefixed_chunk_attention(q, k_cache, v_cache, layer, page_row, prefix_len, slot_mapping, page_size, scale):
        """A step that is one sequence's chunk after a cached prefix (EngineConfig.prefixed_chunk_attention):
        two cuDNN flash attentions merged by their log-sum-exps on GPUs (16-bit only; XLA's otherwise)."""
        return reference.prefixed_chunk_attention(q, k_cache, v_cache, layer, page_row, prefix_len, slot_mapping,
                                                  page_size, scale, implementation=one_sequence_implementation(q))

    def one_sequence_implementation(q) -> str:
        """cuDNN for 16-bit queries where it runs (not in interpret mode), else XLA's attention."""
        cudnn = not interpret and q.dtype in (jnp.bfloat16, jnp.float16) and cudnn_flash_attention_available()
        return "cudnn" if cudnn else "xla"

    ops["fresh_prompt_attention"] = fresh_prompt_attention
    ops["prefixed_chunk_attention"] = prefixed_chunk_attention
    base = "pallas-unfused-rope" if not fused_decode_rope else "pallas" if flash_prefill else "pallas-xla-attention"
    return OpSet(**ops, name=base + ("-interpret" if interpret else ""))


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
