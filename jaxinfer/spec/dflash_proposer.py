"""DFlash proposals in the engine: a block drafter (spec/dflash.py) that drafts block_size - 1 tokens a sequence
in one pass from the target's own hidden states.

The target's prompt and verify steps also return the outputs of the drafter's target layers
(ModelRunner(capture_layers=...)); after each such step `observe` turns them into every drafter layer's context
K/V (fused by `fc`, projected, k-normed, RoPE) and writes them into the drafter's own paged pool at the rows'
slots: the pool has the target's pages and is indexed by the target's page tables, so prefix-cached pages carry
their drafter context too, and rows that were rejected drafts are overwritten later like the target's own K/V.
`propose` then runs the drafter once over each sequence's block (its last token, then mask tokens, at the
positions after its context), writing the block's own K/V into the pool where the next steps overwrite them, each
block row seeing the whole context and the whole block (no causal mask, as the authors'). Drafts are the argmax
of the block's logits through the target's lm_head (greedy proposals: one-hot in the rejection test).

A decode dispatch returns no layer states, so with a DFlash drafter every decode step is a verify step (the
adaptive draft count stays at 1 or more).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kv_cache import SCRATCH_PAGE, KVCache, bytes_per_page, slots_for
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.runner.transfer import to_device
from jaxinfer.settings import EngineConfig
from jaxinfer.spec.dflash import _cos_sin, _split_kv, fuse_target_states, target_embedding_and_head
from jaxinfer.spec.dflash_config import DFlashConfig, check_drafter_fits, load_dflash_config, load_dflash_params
from jaxinfer.spec.proposer import DraftedSequence


def write_context(dcfg: DFlashConfig, ops: ModuleType, params: dict, pool: KVCache, states: jax.Array,
                  positions: jax.Array, slots: jax.Array) -> KVCache:
    """Every drafter layer's context K/V of the rows whose target states are `states` [n, T, D] (at positions
    [T]), written into the pool at `slots` [T]."""
    cfg = dcfg.model
    ctx = fuse_target_states(dcfg, ops, params, states)
    cos_sin = _cos_sin(cfg, ops, positions)

    def layer(carry, layer_in):
        kc, vc = carry
        lp, index = layer_in
        k, v = _split_kv(cfg, ops, lp, ctx, cos_sin)
        return ops.write_kv(kc, vc, index, k, v, slots), None

    (k, v), _ = jax.lax.scan(layer, (pool.k, pool.v), (params["layers"], jnp.arange(cfg.num_layers)))
    return pool.replace(k=k, v=v)


def draft_block(dcfg: DFlashConfig, ops: ModuleType, params: dict, pool: KVCache, embed: jax.Array,
                head: jax.Array, last: jax.Array, start: jax.Array, page_table: jax.Array,
                block_slots: jax.Array) -> tuple[KVCache, jax.Array]:
    """One drafter pass over B blocks: last [B] (each sequence's last token, at position start[B]), page_table
    [B, P], block_slots [B, block_size]. Returns (the pool with the blocks' K/V written, greedy drafts
    [B, block_size - 1])."""
    cfg, bs = dcfg.model, dcfg.block_size
    B = last.shape[0]
    T = B * bs
    ids = jnp.full((B, bs), dcfg.mask_token_id, jnp.int32).at[:, 0].set(last)
    x = embed[ids.reshape(T)].astype(cfg.jnp_dtype)
    positions = (start[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]).reshape(T)
    cos_sin = _cos_sin(cfg, ops, positions)
    token_seq = jnp.repeat(jnp.arange(B, dtype=jnp.int32), bs)
    sees = jnp.repeat(start + bs - 1, bs)    # every block row sees the context and the whole block
    slots = block_slots.reshape(T)

    def layer(carry, layer_in):
        x, kc, vc = carry
        lp, index = layer_in
        h = ops.rms_norm(x, lp["attn_norm"]["scale"], cfg.norm_eps)
        qkv = ops.linear(h, lp["wqkv"], lp.get("bqkv"))
        q = ops.rms_norm(qkv[:, :cfg.q_size].reshape(T, cfg.num_heads, cfg.head_dim), lp["q_norm"], cfg.norm_eps)
        q = ops.apply_rope(q, *cos_sin)
        k, v = _split_kv(cfg, ops, lp, h, cos_sin)
        kc, vc = ops.write_kv(kc, vc, index, k, v, slots)
        attn = ops.paged_attention(q, kc, vc, index, page_table, token_seq, sees, pool.page_size,
                                   cfg.head_dim ** -0.5)
        x = x + ops.linear(attn.reshape(T, cfg.q_size), lp["wo"], lp.get("bo"))
        gate_up = ops.linear(ops.rms_norm(x, lp["mlp_norm"]["scale"], cfg.norm_eps), lp["w_gate_up"])
        return (x + ops.linear(ops.swiglu(gate_up), lp["w_down"]), kc, vc), None

    (x, k, v), _ = jax.lax.scan(layer, (x, pool.k, pool.v), (params["layers"], jnp.arange(cfg.num_layers)))
    h = ops.rms_norm(x, params["norm"], cfg.norm_eps).reshape(B, bs, -1)[:, 1:]
    logits = ops.logits(h.reshape(B * (bs - 1), -1), head)
    return pool.replace(k=k, v=v), jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(B, bs - 1)


class DFlashProposer:
    name = "dflash"
    needs_every_step = True   # its context comes from the target's prompt and verify steps only

    def __init__(self, path: str, target_cfg: ModelConfig, config: EngineConfig):
        if not path:
            raise ValueError("speculative dflash:DIR needs the drafter's folder")
        self.path = Path(path)
        self.target_cfg = target_cfg
        self.dcfg = load_dflash_config(self.path, target_cfg.dtype)
        check_drafter_fits(self.dcfg, target_cfg)
        self.params = load_dflash_params(self.path, self.dcfg)
        self.capture_layers = self.dcfg.target_layer_ids
        self.pool: KVCache | None = None

    def page_bytes(self, page_size: int) -> int:
        return bytes_per_page(self.dcfg.model, page_size)

    def attach(self, num_pages: int, max_model_len: int, ops: ModuleType, target_runner: ModelRunner) -> None:
        self.runner = target_runner
        self.pool = KVCache.allocate(self.dcfg.model, num_pages, target_runner.page_size)
        self.embed, self.head = target_embedding_and_head(self.target_cfg, target_runner.params)
        self._write = jax.jit(functools.partial(write_context, self.dcfg, ops), donate_argnums=(1,))
        self._draft = jax.jit(functools.partial(draft_block, self.dcfg, ops), donate_argnums=(1,))

    def observe(self, states: jax.Array, positions: np.ndarray, slots: np.ndarray) -> None:
        """A target step's captured states [n, T, D] of rows at positions/slots [T] (host arrays)."""
        self.pool = self._write(self.params, self.pool, states, *to_device((positions, slots)))

    def propose(self, seqs: Sequence[DraftedSequence], k: int) -> list[list[int]]:
        r, ps, bs = self.runner, self.runner.page_size, self.dcfg.block_size
        B = r.batch_bucket(len(seqs))
        last = np.zeros(B, np.int32)
        start = np.zeros(B, np.int32)
        page_table = r.empty_page_table(B)
        block_slots = np.full((B, bs), SCRATCH_PAGE * ps, np.int32)
        for b, seq in enumerate(seqs):
            n = len(seq.tokens)
            last[b], start[b] = seq.tokens[-1], n - 1
            page_table[b, :len(seq.pages)] = seq.pages
            held = min(bs, len(seq.pages) * ps - (n - 1))   # block rows past the held pages write to scratch
            block_slots[b, :held] = slots_for(seq.pages, n - 1, n - 1 + held, ps)
        self.pool, drafts = self._draft(self.params, self.pool, self.embed, self.head,
                                        *to_device((last, start, page_table, block_slots)))
        drafts = np.asarray(drafts)
        return [drafts[b, :k].tolist() for b in range(len(seqs))]
