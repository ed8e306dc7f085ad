"""The DFlash block drafter's forward pass, as pure functions (z-lab's DFlashDraftModel, arXiv 2602.06036).

The drafter reads the target's hidden states at a few layers (DFlashConfig.target_layer_ids: the output of
target layer l, transformers' hidden_states[l + 1]) for every committed position but the last, fuses them
(`fc` over their concatenation, then an RMSNorm) into one context feature a position, and drafts a whole block
in one pass: the block's input is the last committed token followed by block_size - 1 mask tokens, embedded
with the target's embedding; each drafter layer's queries are the block's positions, its keys and values the
context features' (projected by that layer's k/v, k-normed, RoPE at their positions) followed by the block's
own; no causal mask. The final-normed block states after the first go through the target's lm_head: logits
[block_size - 1, V] for the next block_size - 1 tokens.

The context's K/V depend only on the context features, never on the block, so a drafter keeps them per
sequence (`DraftContext`) and a step adds only its newly committed positions (`extend_context`), as the
authors' cache does (it crops the block's rows after every pass). `draft_logits` then reads that state;
`draft_logits_from_states` recomputes everything from all the context features (the simple form, for tests).
"""

from __future__ import annotations

import functools
from types import ModuleType

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import transformer
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kv_cache import KVCache
from jaxinfer.spec.dflash_config import DFlashConfig

f32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


@flax.struct.dataclass
class DraftContext:
    """One sequence's drafter state: every drafter layer's K/V of the context positions 0..length-1
    (k, v [L, capacity, KVH, hd], RoPE applied), and length (int32 scalar)."""
    k: jax.Array
    v: jax.Array
    length: jax.Array

    @staticmethod
    def empty(dcfg: DFlashConfig, capacity: int) -> "DraftContext":
        cfg = dcfg.model
        shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim)
        return DraftContext(jnp.zeros(shape, cfg.jnp_dtype), jnp.zeros(shape, cfg.jnp_dtype), jnp.int32(0))


def fuse_target_states(dcfg: DFlashConfig, ops: ModuleType, params: dict, states: jax.Array) -> jax.Array:
    """The context features [T, D] of the target's states [n, T, D] at dcfg.target_layer_ids (in that order)."""
    n, T, D = states.shape
    joined = jnp.moveaxis(states, 0, 1).reshape(T, n * D).astype(dcfg.model.jnp_dtype)
    return ops.rms_norm(ops.linear(joined, params["fc"]), params["hidden_norm"], dcfg.model.norm_eps)


def _cos_sin(cfg: ModelConfig, ops: ModuleType, positions: jax.Array):
    return ops.rope_cos_sin(positions, jnp.asarray(cfg.rope_inv_freq()), cfg.jnp_dtype)


def _split_kv(cfg: ModelConfig, ops: ModuleType, lp: dict, x: jax.Array, cos_sin) -> tuple[jax.Array, jax.Array]:
    """One layer's K (k-normed, RoPE) and V [T, KVH, hd] of the rows x [T, D]."""
    T = x.shape[0]
    kv = ops.linear(x, lp["wqkv"][cfg.q_size:], None if "bqkv" not in lp else lp["bqkv"][cfg.q_size:])
    k, v = jnp.split(kv, 2, axis=-1)
    k = ops.rms_norm(k.reshape(T, cfg.num_kv_heads, cfg.head_dim), lp["k_norm"], cfg.norm_eps)
    return ops.apply_rope(k, *cos_sin), v.reshape(T, cfg.num_kv_heads, cfg.head_dim)


def context_kv(dcfg: DFlashConfig, ops: ModuleType, params: dict, states: jax.Array,
               positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every drafter layer's K/V [L, T, KVH, hd] of context positions `positions` [T], from the target's
    states [n, T, D] there."""
    cfg = dcfg.model
    ctx = fuse_target_states(dcfg, ops, params, states)
    cos_sin = _cos_sin(cfg, ops, positions)
    return jax.lax.map(lambda lp: _split_kv(cfg, ops, lp, ctx, cos_sin), params["layers"])


def extend_context(dcfg: DFlashConfig, ops: ModuleType, params: dict, context: DraftContext, states: jax.Array,
                   count: jax.Array) -> DraftContext:
    """Add the context positions length..length+count-1, from the target's states [n, N, D] there (N >= count:
    rows past count are padding, written but not counted; a later extend overwrites them). The capacity must
    hold length + N rows (dynamic_update_slice would move the write back otherwise)."""
    positions = context.length + jnp.arange(states.shape[1], dtype=jnp.int32)
    k, v = context_kv(dcfg, ops, params, states, positions)
    at = (0, context.length, 0, 0)
    return DraftContext(jax.lax.dynamic_update_slice(context.k, k.astype(context.k.dtype), at),
                        jax.lax.dynamic_update_slice(context.v, v.astype(context.v.dtype), at),
                        context.length + jnp.asarray(count, jnp.int32))


def _block_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float) -> jax.Array:
    """q [Q, H, hd] over k, v [S, KVH, hd] (grouped heads), keys where visible [S]; no causal mask."""
    Q, H, hd = q.shape
    kvh = k.shape[1]
    qg = q.astype(f32).reshape(Q, kvh, H // kvh, hd)
    s = jnp.einsum("qkgd,skd->qkgs", qg, k.astype(f32), precision=HIGHEST) * scale
    p = jax.nn.softmax(jnp.where(visible[None, None, None, :], s, -jnp.inf), axis=-1)
    out = jnp.einsum("qkgs,skd->qkgd", p, v.astype(f32), precision=HIGHEST)
    return out.reshape(Q, H, hd).astype(q.dtype)


def _draft_layer(cfg: ModelConfig, ops: ModuleType, x, lp, ctx_k, ctx_v, visible, cos_sin):
    Q = x.shape[0]
    h = ops.rms_norm(x, lp["attn_norm"]["scale"], cfg.norm_eps)
    qkv = ops.linear(h, lp["wqkv"], lp.get("bqkv"))
    q = ops.rms_norm(qkv[:, :cfg.q_size].reshape(Q, cfg.num_heads, cfg.head_dim), lp["q_norm"], cfg.norm_eps)
    q = ops.apply_rope(q, *cos_sin)
    k, v = _split_kv(cfg, ops, lp, h, cos_sin)
    attn = _block_attention(q, jnp.concatenate([ctx_k.astype(k.dtype), k]), jnp.concatenate([ctx_v.astype(v.dtype), v]),
                            jnp.concatenate([visible, jnp.ones(Q, bool)]), cfg.head_dim ** -0.5)
    x = x + ops.linear(attn.reshape(Q, cfg.q_size), lp["wo"], lp.get("bo"))
    gate_up = ops.linear(ops.rms_norm(x, lp["mlp_norm"]["scale"], cfg.norm_eps), lp["w_gate_up"])
    return x + ops.linear(ops.swiglu(gate_up), lp["w_down"])


def draft_hidden(dcfg: DFlashConfig, ops: ModuleType, params: dict, context: DraftContext,
                 block_embeds: jax.Array) -> jax.Array:
    """The final-normed drafter states [block_size, D] of a block whose embeddings are block_embeds
    [block_size, D], at positions context.length.. (right after the context)."""
    cfg = dcfg.model
    Q = block_embeds.shape[0]
    cos_sin = _cos_sin(cfg, ops, context.length + jnp.arange(Q, dtype=jnp.int32))
    visible = jnp.arange(context.k.shape[1]) < context.length

    def layer(x, layer_in):
        lp, ctx_k, ctx_v = layer_in
        return _draft_layer(cfg, ops, x, lp, ctx_k, ctx_v, visible, cos_sin), None

    x, _ = jax.lax.scan(layer, block_embeds.astype(cfg.jnp_dtype), (params["layers"], context.k, context.v))
    return ops.rms_norm(x, params["norm"], cfg.norm_eps)


def block_input_ids(dcfg: DFlashConfig, last_token: jax.Array) -> jax.Array:
    """The block's input [block_size]: the last committed token, then mask tokens."""
    ids = jnp.full((dcfg.block_size,), dcfg.mask_token_id, jnp.int32)
    return ids.at[0].set(jnp.asarray(last_token, jnp.int32))


def target_embedding_and_head(target: ModelConfig, target_params: dict) -> tuple[jax.Array, jax.Array]:
    """The target's embedding [V, D] and lm_head [V, D] (the embedding again where they are tied): the drafter
    embeds its block and makes its logits with them."""
    return target_params["embed"], target_params["embed" if target.tie_embeddings else "lm_head"]


def draft_logits(dcfg: DFlashConfig, ops: ModuleType, params: dict, context: DraftContext, last_token: jax.Array,
                 embed: jax.Array, head: jax.Array) -> jax.Array:
    """float32 logits [block_size - 1, V] of the block_size - 1 tokens after last_token (at position
    context.length), from the drafter state `context` of positions 0..context.length-1."""
    ids = block_input_ids(dcfg, last_token)
    h = draft_hidden(dcfg, ops, params, context, embed[ids])
    return ops.logits(h[1:], head)


def draft_logits_from_states(dcfg: DFlashConfig, ops: ModuleType, params: dict, states: jax.Array,
                             last_token: jax.Array, embed: jax.Array, head: jax.Array) -> jax.Array:
    """draft_logits recomputing the whole context from the target's states [n, T, D] at positions 0..T-1."""
    context = extend_context(dcfg, ops, params, DraftContext.empty(dcfg, states.shape[1]), states, states.shape[1])
    return draft_logits(dcfg, ops, params, context, last_token, embed, head)


@functools.partial(jax.jit, static_argnums=(0, 1, 4))
def _layer_states(cfg: ModelConfig, ops: ModuleType, params: dict, token_ids: jax.Array,
                  layer_ids: tuple[int, ...], page_size: int = 16) -> jax.Array:
    T = token_ids.shape[0]
    n_pages = -(-T // page_size)
    kv = KVCache.allocate(cfg, n_pages + 1, page_size)
    pages = jnp.arange(1, n_pages + 1, dtype=jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)
    slots = pages[pos // page_size] * page_size + pos % page_size
    x = transformer.embed(cfg, params, token_ids, pos)
    out, done = [], 0
    for layer in sorted(set(layer_ids)):
        kv, x = transformer.run_layers(cfg, ops, params, kv, x, pos, slots, jnp.zeros(T, jnp.int32), pages[None],
                                       done, layer + 1)
        # transformers' last hidden state is the final-normed one
        out.append(transformer.final_norm(cfg, ops, params, x) if layer == cfg.num_layers - 1 else x)
        done = layer + 1
    by_layer = dict(zip(sorted(set(layer_ids)), out))
    return jnp.stack([by_layer[layer] for layer in layer_ids])


def target_layer_states(cfg: ModelConfig, ops: ModuleType, params: dict, token_ids: np.ndarray,
                        layer_ids: tuple[int, ...]) -> jax.Array:
    """The target's hidden states [len(layer_ids), T, D] after each layer of layer_ids (transformers'
    hidden_states[l + 1]) for one token sequence from position 0, through a throwaway cache (tests, research,
    drafter training)."""
    if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= cfg.num_layers:
        raise ValueError(f"layer ids {list(layer_ids)} outside the target's {cfg.num_layers} layers")
    return _layer_states(cfg, ops, params, jnp.asarray(token_ids, jnp.int32), tuple(int(i) for i in layer_ids))
