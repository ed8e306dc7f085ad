"""The transformer as pure functions of (config, ops, params, kv cache, step arrays).

One forward function serves every family; the differences are ModelConfig fields. Layers are a
`lax.scan` over the stacked per-layer parameters, with the KV cache in the carry so that XLA
updates it in place; or, with the parameters split per layer (`split_layers`, the engine's choice
on GPUs), straight-line code in which every GEMM reads its layer's weights where they lie.
"""

from __future__ import annotations

import functools
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import rotary
from jaxinfer.model.config import ModelConfig
from jaxinfer.model import tensor_parallel
from jaxinfer.model.kv_cache import KVCache
from jaxinfer.ops import LayerWeight
from jaxinfer.ops.quantized import QuantizedWeight


def _layer_params(layers: dict, layer: jax.Array) -> dict:
    """One layer's parameters, each left in its stacked [L, ...] array with the layer index
    (LayerWeight), so that kernels read them in place instead of XLA copying out a slice."""
    return jax.tree.map(lambda a: LayerWeight(a, layer), layers, is_leaf=_is_quantized)


def _is_quantized(a) -> bool:
    """A QuantizedWeight is one weight to the layer trees (its values and scale go together)."""
    return isinstance(a, QuantizedWeight)


def _norm(ops: ModuleType, cfg: ModelConfig, x: jax.Array, p: dict) -> jax.Array:
    if cfg.norm_kind == "rms":
        return ops.rms_norm(x, p["scale"], cfg.norm_eps)
    return ops.layer_norm(x, p["scale"], p["bias"], cfg.norm_eps)


def _attention_block(cfg, ops, lp, x, kv_k, kv_v, layer, cos_sin, tokens_arrays, page_size, decode,
                     attention="paged"):
    positions, slot_mapping, token_seq, page_table = tokens_arrays
    T = x.shape[0]
    # this layer's sliding window, a traced scalar (the layer index is one); no keyword at all without windows
    windowed = {} if not cfg.has_windows else {"window": cfg.window_of(layer)}
    if windowed and attention in ("fresh", "prefixed"):   # one sequence's prompt: the paged kernels skip by window
        attention = "paged"
    qkv = _norm_linear(ops, cfg, x, lp["attn_norm"], lp["wqkv"], lp.get("bqkv"))
    if decode:  # one token per sequence, in sequence order: the split-sequence decode kernel's case
        attn, kv_k, kv_v = ops.decode_qkv_attention(qkv, cos_sin, lp.get("q_norm"), lp.get("k_norm"), cfg.norm_eps,
                                                    kv_k, kv_v, layer, slot_mapping, page_table, positions + 1,
                                                    page_size, cfg.head_dim ** -0.5, cfg.num_heads, cfg.num_kv_heads,
                                                    **windowed)
    else:
        # A fresh prompt's attention takes its K/V from the write where the cache holds them as computed (no
        # gather back: two fewer kernels a layer); from a float8 cache it reads them back, as the paged kernels do
        with_kv = attention == "fresh" and kv_k.dtype == qkv.dtype
        q, kv_k, kv_v, *kv = ops.qkv_rope_write(qkv, cos_sin, lp.get("q_norm"), lp.get("k_norm"), cfg.norm_eps,
                                                kv_k, kv_v, layer, slot_mapping, cfg.num_heads, cfg.num_kv_heads,
                                                with_kv=with_kv)
        if attention == "fresh":   # the step is one prompt from position 0: attention over its own rows
            k, v = kv if with_kv else ops.gather_kv(kv_k, kv_v, layer, slot_mapping, q.dtype)
            attn = ops.fresh_prompt_attention(q, k, v, cfg.head_dim ** -0.5, **windowed)
        elif attention == "verify":   # B sequences of Q rows each, in order (a speculative verify step)
            B = page_table.shape[0]
            qb = q.reshape(B, T // B, *q.shape[1:])
            context_lens = positions.reshape(B, T // B)[:, -1] + 1
            attn = ops.verify_attention(qb, kv_k, kv_v, layer, page_table, context_lens, page_size,
                                        cfg.head_dim ** -0.5, **windowed)
        elif attention == "prefixed":   # one sequence's chunk after its cached prefix (row 0 of the page table)
            attn = ops.prefixed_chunk_attention(q, kv_k, kv_v, layer, page_table[0], positions[0], slot_mapping,
                                                page_size, cfg.head_dim ** -0.5, **windowed)
        else:
            attn = ops.paged_attention(q, kv_k, kv_v, layer, page_table, token_seq, positions,
                                       page_size, cfg.head_dim ** -0.5, **windowed)
    return attn.reshape(T, cfg.q_size), kv_k, kv_v


def _norm_linear(ops, cfg, x, norm_p, w, b):
    if cfg.norm_kind == "rms":
        return ops.rms_norm_linear(x, norm_p["scale"], cfg.norm_eps, w, b)
    return ops.linear(_norm(ops, cfg, x, norm_p), w, b)


def _attention_out_mlp(cfg, ops, lp, attn, x):
    """The attention's output projection into the residual stream x, then the MLP block (or mixture of experts)."""
    if cfg.num_experts:
        x = ops.linear_residual(attn, lp["wo"], lp.get("bo"), x)
        return ops.rms_norm_moe_mlp(x, lp["mlp_norm"]["scale"], cfg.norm_eps, lp["router"], lp["moe_gate_up"],
                                    lp["moe_down"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    if cfg.mlp_kind == "swiglu" and cfg.norm_kind == "rms":
        # one op, so that a batched step can fuse the projection's finish with the norm (ops.pallas)
        x, h = ops.linear_residual_norm_swiglu(attn, lp["wo"], lp.get("bo"), x, lp["mlp_norm"]["scale"],
                                               cfg.norm_eps, lp["w_gate_up"])
        return ops.linear_residual(h, lp["w_down"], lp.get("b_down"), x)
    if cfg.sandwich_norms:
        return _sandwich_blocks(cfg, ops, lp, attn, x)
    return _mlp_block(cfg, ops, lp, ops.linear_residual(attn, lp["wo"], lp.get("bo"), x))


def _sandwich_blocks(cfg, ops, lp, attn, x):
    """Gemma 3's output projection and MLP: each block's output RMS-normed before it joins the residual stream."""
    x = x + ops.rms_norm(ops.linear_out(attn, lp["wo"], lp.get("bo")), lp["attn_out_norm"]["scale"], cfg.norm_eps)
    h = _mlp_activation(cfg, ops, lp, x)
    return x + ops.rms_norm(ops.linear_out(h, lp["w_down"], lp.get("b_down")), lp["mlp_out_norm"]["scale"], cfg.norm_eps)


def _mlp_block(cfg, ops, lp, x):
    return ops.linear_residual(_mlp_activation(cfg, ops, lp, x), lp["w_down"], lp.get("b_down"), x)


def _mlp_activation(cfg, ops, lp, x):
    """The MLP's norm, up (and gate) projection and activation: the rows that w_down takes."""
    if cfg.mlp_kind == "swiglu":
        h = ops.swiglu(_norm_linear(ops, cfg, x, lp["mlp_norm"], lp["w_gate_up"], None))
    elif cfg.mlp_kind == "geglu":
        h = ops.geglu(_norm_linear(ops, cfg, x, lp["mlp_norm"], lp["w_gate_up"], None))
    elif cfg.mlp_kind == "xielu":
        h = ops.xielu(_norm_linear(ops, cfg, x, lp["mlp_norm"], lp["w_up"], lp.get("b_up")), lp["xielu"])
    else:
        h = ops.gelu(_norm_linear(ops, cfg, x, lp["mlp_norm"], lp["w_up"], lp.get("b_up")),
                     approximate=cfg.activation == "gelu_tanh")
    return h


def _layer(cfg, ops, page_size, decode, carry, lp, index, cos_sin, token_arrays, attention="paged"):
    x, kv_k, kv_v = carry
    attn, kv_k, kv_v = _attention_block(cfg, ops, lp, x, kv_k, kv_v, index, rotary.layer_cos_sin(cfg, cos_sin, index),
                                        token_arrays, page_size, decode, attention)
    return _attention_out_mlp(cfg, ops, lp, attn, x), kv_k, kv_v


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 10))
def _split_layer(cfg, ops, page_size, decode, carry, matrices, vectors, index, cos_sin, token_arrays,
                 attention="paged"):
    """One layer of the straight-line (split_layers) loop, as a nested jit: every layer has the same
    argument shapes, so JAX traces and lowers it once per step instead of once per layer (36 layers:
    the start-up cost of each compiled step), and XLA inlines the calls back into straight-line code.
    matrices: this layer's own arrays; vectors: the stacked [L, ...] ones, read at `index`."""
    # each matrix reaches the ops as a one-layer stack (a free reshape)
    lp = _merge_holes(jax.tree.map(lambda a: LayerWeight(a[None], jnp.int32(0)), matrices, is_leaf=_is_quantized),
                      _layer_params(vectors, index))
    return _layer(cfg, ops, page_size, decode, carry, lp, index, cos_sin, token_arrays, attention)


def _merge_holes(a, b):
    """Two trees of one structure whose leaves are each present in exactly one (None in the other; a
    whole tree may be None)."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, dict):
        return {k: _merge_holes(a.get(k), b.get(k)) for k in a.keys() | b.keys()}
    return a


def hidden_states(cfg: ModelConfig, ops: ModuleType, params: dict, kv: KVCache, tokens: jax.Array,
                  positions: jax.Array, slot_mapping: jax.Array, token_seq: jax.Array,
                  page_table: jax.Array, decode: bool = False, unroll: bool = False,
                  attention: str = "paged", capture: tuple[int, ...] = (),
                  rope_long: jax.Array | None = None) -> tuple[KVCache, jax.Array]:
    """Run every layer on the ragged tokens [T]; write their K/V; return the final-normed states [T, D] (and with
    `capture`, the outputs of those layers [len(capture), T, D], as transformers' hidden_states[l + 1]).

    decode: token t is the single new token of sequence t (T == B), at position `positions[t]`.
    unroll: unroll the layer loop (no while loop on the device; longer compile).
    attention (prompt tokens): "paged" (ops.paged_attention); "fresh": the tokens are one prompt from
    position 0 (then padding), ops.fresh_prompt_attention; "prefixed": they are one sequence's chunk after
    its cached prefix (page table row 0), ops.prefixed_chunk_attention; "verify": T = B * Q rows, Q a sequence
    in order, the last of them at the sequence's end (ops.verify_attention).
    rope_long: bool [B], the sequences whose every token takes LongRoPE's long factors, the others' tokens each by
    its own position (rotary.cos_sin); None: every sequence's by its last position in the step.
    """
    x = embed(cfg, params, tokens, positions)
    kv, x, *states = run_layers(cfg, ops, params, kv, x, positions, slot_mapping, token_seq, page_table, 0,
                                cfg.num_layers, decode, unroll, attention, capture, rope_long)
    h = final_norm(cfg, ops, params, x)
    if capture:   # transformers' hidden_states[L] (the last layer's output) is the final-normed one
        states = states[0]
        if cfg.num_layers - 1 in capture:
            states = states.at[capture.index(cfg.num_layers - 1)].set(h)
        return kv, h, states
    return kv, h


def embed(cfg: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """The residual stream [T, D] before the first layer."""
    x = params["embed"][tokens]
    if cfg.embed_scale != 1.0:   # Gemma 3: the scale rounded to the model's dtype first, as transformers does
        x = x * jnp.asarray(np.float32(cfg.embed_scale)).astype(x.dtype)
    if cfg.position_kind == "learned":
        x = x + params["pos_embed"][positions]
    return x


def final_norm(cfg: ModelConfig, ops: ModuleType, params: dict, x: jax.Array) -> jax.Array:
    return _norm(ops, cfg, x, params["final_norm"])


def run_layers(cfg: ModelConfig, ops: ModuleType, params: dict, kv: KVCache, x: jax.Array, positions: jax.Array,
               slot_mapping: jax.Array, token_seq: jax.Array, page_table: jax.Array, first: int, last: int,
               decode: bool = False, unroll: bool = False, attention: str = "paged",
               capture: tuple[int, ...] = (), rope_long: jax.Array | None = None) -> tuple[KVCache, jax.Array]:
    """Layers first..last-1 on the residual stream x [T, D] (arguments as hidden_states'): (kv, x). With split
    layers, params["layers"][i] is layer i's (entries outside the range may be None: a step that runs part of
    the model takes only its part's matrices as arguments). capture: layers (within first..last-1) whose
    outputs are also returned, (kv, x, their outputs [len(capture), T, D]) (a DFlash drafter reads them)."""
    if getattr(ops, "mesh", None) is not None:   # tensor parallel: the same layers per shard, under shard_map
        return tensor_parallel.run_layers_sharded(run_layers, cfg, ops, params, kv, x, positions, slot_mapping,
                                                  token_seq, page_table, first=first, last=last, decode=decode,
                                                  unroll=unroll, attention=attention, capture=capture,
                                                  rope_long=rope_long)
    captured = {}
    cos_sin = None
    if cfg.position_kind == "rope":
        cos_sin = rotary.cos_sin(cfg, ops, positions, token_seq, page_table.shape[0], x.dtype, decode, rope_long)
    token_arrays = (positions, slot_mapping, token_seq, page_table)

    def layer(carry, lp, index):
        return _layer(cfg, ops, kv.page_size, decode, carry, lp, index, cos_sin, token_arrays, attention)

    carry = (x, kv.k, kv.v)
    if isinstance(params["layers"], (list, tuple)):  # per-layer arrays (split_layers): straight-line code
        for i in range(first, last):
            carry = _split_layer(cfg, ops, kv.page_size, decode, carry, params["layers"][i], params["layer_vectors"],
                                 jnp.int32(i), cos_sin, token_arrays, attention)
            captured[i] = carry[0]
    else:   # a scan a stretch between captured layers
        ends = sorted({i + 1 for i in capture if first <= i < last} | {last})
        start = first
        for end in ends:
            indices = jnp.arange(start, end, dtype=jnp.int32)
            carry, _ = jax.lax.scan(lambda c, i: (layer(c, _layer_params(params["layers"], i), i), None), carry,
                                    indices, unroll=unroll)
            captured[end - 1] = carry[0]
            start = end
    x, k, v = carry
    if capture:
        return kv.replace(k=k, v=v), x, jnp.stack([captured[i] for i in capture])
    return kv.replace(k=k, v=v), x


def split_layers(params: dict) -> dict:
    """The stacked [L, ...] layer matrices as a list of per-layer trees ("layers"); the vectors (norm
    scales, biases) stay stacked ("layer_vectors"). With them the layer loop is straight-line code and
    XLA's own GEMMs (prefill, batched decode) read each layer's matrices where they lie: a slice of a
    stack would be copied out first, every step (all the weights' bytes again). Vectors are read in place
    by the kernels and by XLA's fusions, and stay stacked because every array is an argument of every step,
    each costing host time at the call (bench/dispatch_args.py). While it runs the device holds the
    matrices twice."""
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda a: a[i] if a.ndim >= 3 else None, stacked, is_leaf=_is_quantized)
                                 for i in range(n)],
            "layer_vectors": jax.tree.map(lambda a: a if a.ndim < 3 else None, stacked, is_leaf=_is_quantized)}


def lm_head(cfg: ModelConfig, ops: ModuleType, params: dict, h: jax.Array) -> jax.Array:
    """float32 logits [R, V] for the rows h [R, D]. (Quantized tied embeddings keep a quantized copy as lm_head.)"""
    w = params["lm_head"] if "lm_head" in params else params["embed"]
    if getattr(ops, "mesh", None) is not None:   # vocabulary-parallel: logits stay sharded by vocabulary
        logits = tensor_parallel.sharded_logits(ops, h, w, cfg.vocab_size)
    else:
        logits = ops.logits(h, w)
    if cfg.final_logit_softcap:   # Gemma: c * tanh(logits / c)
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def forward(cfg: ModelConfig, ops: ModuleType, params: dict, kv: KVCache, tokens: jax.Array,
            positions: jax.Array, slot_mapping: jax.Array, token_seq: jax.Array, page_table: jax.Array,
            logits_rows: jax.Array, decode: bool = False, unroll: bool = False,
            attention: str = "paged", rope_long: jax.Array | None = None) -> tuple[KVCache, jax.Array]:
    """One forward pass; logits [R, V] only for the token rows `logits_rows` [R]."""
    kv, h = hidden_states(cfg, ops, params, kv, tokens, positions, slot_mapping, token_seq, page_table,
                          decode, unroll, attention, rope_long=rope_long)
    return kv, lm_head(cfg, ops, params, h[logits_rows])


def prompt_logits(cfg: ModelConfig, ops: ModuleType, params: dict, token_ids: np.ndarray,
                  page_size: int = 16) -> jax.Array:
    """Logits [T, V] of every position of one prompt, through a throwaway cache (tests, research)."""
    T = len(token_ids)
    n_pages = -(-T // page_size)
    kv = tensor_parallel.allocate_kv(cfg, getattr(ops, "mesh", None), n_pages + 1, page_size)
    pages = np.arange(1, n_pages + 1, dtype=np.int32)
    pos = np.arange(T, dtype=np.int32)
    slots = pages[pos // page_size] * page_size + pos % page_size
    _, logits = jax.jit(forward, static_argnums=(0, 1))(
        cfg, ops, params, kv, jnp.asarray(token_ids, jnp.int32), jnp.asarray(pos), jnp.asarray(slots),
        jnp.zeros(T, jnp.int32), jnp.asarray(pages)[None, :], jnp.asarray(pos))
    return logits
