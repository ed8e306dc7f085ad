"""The pure step functions: (params, kv, state, batch) -> (kv, state, outputs...), jitted by the runner.

- `mixed_step`: a ragged batch of prompt chunks and single decode tokens; samples the rows that emit.
- `decode_steps`: n decode steps for B sequences in one dispatch (a `lax.scan`), so the host is off the
  critical path.
- `mixed_head` / `mixed_tail`: a one-sequence prompt step in two parts (split_step.py).
- `verify_step`: a mixed step whose sequences may also verify drafted tokens (speculative decoding).
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp

from jaxinfer.model import transformer as model
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kv_cache import SCRATCH_PAGE, KVCache, slot_of
from jaxinfer.runner.batch import CARRIED, DecodeBatch, SamplerState, StepBatch, VerifyBatch
from jaxinfer.runner.transfer import unpacked
from jaxinfer.sampling.rejection import verify
from jaxinfer.sampling.sample import sample, top_logprobs


def _gather_rows(state: SamplerState, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    return state.prompt_mask[rows], state.output_counts[rows]


def _count(state: SamplerState, rows: jax.Array, tokens: jax.Array, emits: jax.Array,
           keep_last: bool = False) -> SamplerState:
    """Count the emitting rows' tokens for the penalties (and with keep_last, store them as the rows'
    last_tokens: a mixed step's, for a step launched before they are read back)."""
    scratch = state.output_counts.shape[0] - 1
    rows = jnp.where(emits, rows, scratch)
    state = state.replace(output_counts=state.output_counts.at[rows, tokens].add(1))
    return state.replace(last_tokens=state.last_tokens.at[rows].set(tokens)) if keep_last else state


def init_row(state: SamplerState, row: jax.Array, token_ids: jax.Array, n_prompt: jax.Array,
             n_total: jax.Array) -> SamplerState:
    """Start a sequence's penalty row: token_ids [N] (padded) holds its prompt (the first n_prompt)
    and what it already generated (up to n_total, after a preemption)."""
    pos = jnp.arange(token_ids.shape[0])
    vocab = state.prompt_mask.shape[1]
    prompt_ids = jnp.where(pos < n_prompt, token_ids, vocab)                     # vocab: dropped
    output_ids = jnp.where((pos >= n_prompt) & (pos < n_total), token_ids, vocab)
    mask = jnp.zeros((vocab,), bool).at[prompt_ids].set(True, mode="drop")
    counts = jnp.zeros((vocab,), jnp.int32).at[output_ids].add(1, mode="drop")
    return state.replace(prompt_mask=state.prompt_mask.at[row].set(mask),
                         output_counts=state.output_counts.at[row].set(counts))


def mixed_step(cfg: ModelConfig, ops: ModuleType, n_top: int, params: dict, kv: KVCache, state: SamplerState,
               batch: StepBatch, greedy: bool = False, attention: str = "paged", method: str = "branch",
               capture: tuple[int, ...] = ()):
    """Prompt chunks and decode tokens together.
    Returns (kv, state, tokens [B], logprobs [B], top values [B, n_top], top ids [B, n_top]).
    greedy: every sampled row is greedy (argmax only: no branch whose predicate the GPU runtime must
    read back mid-step, so the call returns at once, as a decode dispatch's does). method: sample's.
    attention: "paged", or for a step that is one sequence's prompt, "fresh" (from position 0) or
    "prefixed" (a chunk after its cached prefix): model.hidden_states. Such a step carries one sequence, so
    it samples its first row alone (the outputs padded back to B): the sampler's cost grows with its rows
    (the sort over the vocabulary above all). The engine hands it a one-row
    batch (Runner.sampled_rows), whose page table is one row. batch: a StepBatch, or one packed
    into a single buffer (transfer.to_device_packed: split here, one argument instead of ~20)."""
    batch = unpacked(batch)
    rows = _sampled_batch(batch, attention)
    if capture:   # also the outputs of the layers a DFlash drafter reads, [len(capture), T, D], last
        kv, h, states = model.hidden_states(cfg, ops, params, kv, _step_tokens(state, batch), batch.positions,
                                            batch.slot_mapping, batch.token_seq, batch.page_table, attention=attention,
                                            capture=capture, rope_long=batch.rope_long)
        logits = model.lm_head(cfg, ops, params, h[rows.sample_index])
        return (*_sampled(kv, state, batch, rows, logits, n_top, greedy, method), states)
    kv, logits = model.forward(cfg, ops, params, kv, _step_tokens(state, batch), batch.positions, batch.slot_mapping,
                               batch.token_seq, batch.page_table, rows.sample_index, attention=attention,
                               rope_long=batch.rope_long)
    return _sampled(kv, state, batch, rows, logits, n_top, greedy, method)


def _sampled(kv, state, batch, rows, logits, n_top, greedy, method):
    """A mixed step's outputs from its rows' logits: (kv, state, tokens, logprobs, top values, top ids), each
    output padded to the batch's B rows."""
    state, *outs = _sample_rows(logits, n_top, state, rows, greedy, method)
    B = batch.sample_index.shape[0]
    return (kv, state, *(jnp.pad(o, [(0, B - o.shape[0])] + [(0, 0)] * (o.ndim - 1)) for o in outs))


def mixed_head(cfg: ModelConfig, ops: ModuleType, head_layers: int, attention: str, params: dict, kv: KVCache,
               state: SamplerState, batch: StepBatch):
    """The first part of a split mixed step (SplitStep): the embedding and layers 0..head_layers-1.
    Returns (kv, the residual stream [T, D])."""
    batch = unpacked(batch)
    x = model.embed(cfg, params, _step_tokens(state, batch), batch.positions)
    return model.run_layers(cfg, ops, params, kv, x, batch.positions, batch.slot_mapping, batch.token_seq,
                            batch.page_table, 0, head_layers, attention=attention, rope_long=batch.rope_long)


def mixed_tail(cfg: ModelConfig, ops: ModuleType, n_top: int, head_layers: int, params: dict, kv: KVCache,
               state: SamplerState, batch: StepBatch, x: jax.Array, greedy: bool = False, attention: str = "paged",
               method: str = "branch"):
    """The rest of a split mixed step: layers head_layers.. on mixed_head's x, the LM head and the sampling.
    Returns what mixed_step returns."""
    batch = unpacked(batch)
    rows = _sampled_batch(batch, attention)
    kv, x = model.run_layers(cfg, ops, params, kv, x, batch.positions, batch.slot_mapping, batch.token_seq,
                             batch.page_table, head_layers, cfg.num_layers, attention=attention,
                             rope_long=batch.rope_long)
    h = model.final_norm(cfg, ops, params, x)
    return _sampled(kv, state, batch, rows, model.lm_head(cfg, ops, params, h[rows.sample_index]), n_top, greedy,
                    method)


def _sampled_batch(batch: StepBatch, attention: str) -> StepBatch:
    """The rows a mixed step samples: all of a paged step's, a one-sequence ("fresh", "prefixed") step's first."""
    return batch if attention == "paged" else _first_row(batch)


def _first_row(batch: StepBatch) -> StepBatch:
    """The batch with its per-sequence sampling fields cut to the first sequence's."""
    one = lambda x: x[:1]
    return batch.replace(sample_index=one(batch.sample_index), emits=one(batch.emits), state_row=one(batch.state_row),
                         step_index=one(batch.step_index), sampling=jax.tree.map(one, batch.sampling),
                         bitmask=jax.tree.map(one, batch.bitmask))


def _step_tokens(state: SamplerState, batch: StepBatch) -> jax.Array:
    """The step's input tokens: the host's, or where from_state, the one the previous mixed step sampled
    for the token's sequence (not yet read back by the host)."""
    carried = state.last_tokens[batch.state_row[batch.token_seq]]
    return jnp.where(batch.from_state, carried, batch.tokens)


def mixed_step_prompt_logprobs(cfg: ModelConfig, ops: ModuleType, n_top: int, params: dict, kv: KVCache,
                               state: SamplerState, batch: StepBatch):
    """mixed_step, plus logits for every token row: the logprob of the prompt token that follows each
    row ([T]) and the top n_top there ([T, n_top] values, ids). Compiled only when an engine serves
    prompt logprobs: it computes [T, V] logits."""
    batch = unpacked(batch)
    kv, h = model.hidden_states(cfg, ops, params, kv, _step_tokens(state, batch), batch.positions, batch.slot_mapping,
                                batch.token_seq, batch.page_table, rope_long=batch.rope_long)
    logits = model.lm_head(cfg, ops, params, h)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logp, batch.next_tokens[:, None], axis=-1)[:, 0]
    return (kv, *_sample_rows(logits[batch.sample_index], n_top, state, batch), target,
            *top_logprobs(logits, n_top))


def _sample_rows(logits: jax.Array, n_top: int, state: SamplerState, batch: StepBatch, greedy: bool = False,
                 method: str = "branch"):
    rows = batch.state_row
    pm, oc = _gather_rows(state, rows)
    tokens, logprobs = sample(logits, batch.sampling, batch.step_index, pm, oc, greedy_only=greedy, method=method,
                              bitmask=batch.bitmask)
    state = _count(state, rows, tokens, batch.emits, keep_last=True)
    return (state, tokens, logprobs, *top_logprobs(logits, n_top))


def decode_steps(cfg: ModelConfig, ops: ModuleType, n_steps: int, unroll: bool, n_top: int, greedy: bool,
                 params: dict, kv: KVCache, state: SamplerState, batch: DecodeBatch, method: str = "branch"):
    """n_steps decode steps in one dispatch. Returns (kv, state, the batch advanced by n_steps,
    tokens [n, B], logprobs [n, B], emitted [n, B], top values [n, B, n_top], top ids [n, B, n_top]).
    greedy: every row is greedy (argmax only, no branch on the device). method: sample's."""
    B = batch.tokens.shape[0]
    rows = jnp.arange(B, dtype=jnp.int32)

    def one(carry, _):
        kv, state, tokens, positions, step_index, remaining, active = carry
        slots = jnp.where(active, slot_of(batch.page_table, positions, kv.page_size), SCRATCH_PAGE * kv.page_size)
        kv, logits = model.forward(cfg, ops, params, kv, tokens, positions, slots, rows, batch.page_table, rows,
                                   decode=True, unroll=unroll)
        state, carried, outs = _decode_sampled(state, batch, logits, (tokens, positions, step_index, remaining, active),
                                               n_top, greedy, method)
        return (kv, state, *carried), outs

    init = (kv, state, batch.tokens, batch.positions, batch.step_index, batch.remaining, batch.active)
    (kv, state, *carry), outs = jax.lax.scan(one, init, None, length=n_steps)
    return (kv, state, batch.replace(**dict(zip(CARRIED, carry))), *outs)


def _decode_sampled(state: SamplerState, batch: DecodeBatch, logits: jax.Array, carried: tuple, n_top: int,
                    greedy: bool, method: str, bitmask: jax.Array | None = None):
    """A decode step after its forward pass: sample, count for the penalties, advance the carried fields (tokens,
    positions, step_index, remaining, active). Returns (state, the carried fields advanced, outputs: tokens [B],
    logprobs [B], emitted [B], top values [B, n_top], top ids [B, n_top])."""
    tokens, positions, step_index, remaining, active = carried
    pm, oc = _gather_rows(state, batch.state_row)
    new, logprobs = sample(logits, batch.sampling, step_index, pm, oc, greedy_only=greedy, method=method,
                           bitmask=bitmask)
    state = _count(state, batch.state_row, new, active)
    remaining = remaining - active.astype(jnp.int32)
    stopped = jnp.any(new[:, None] == batch.stop_ids, axis=1) | (remaining <= 0)
    step = active.astype(jnp.int32)
    carried = (jnp.where(active, new, tokens), positions + step, step_index + step, remaining, active & ~stopped)
    return state, carried, (new, logprobs, active, *top_logprobs(logits, n_top))


def decode_forward(cfg: ModelConfig, ops: ModuleType, unroll: bool, params: dict, kv: KVCache, batch: DecodeBatch):
    """A constrained decode step's first dispatch (structured output): the forward pass of B sequences' last tokens.
    Returns (kv, logits [B, V]), the logits left on the device for `decode_sample`: the host fills the step's
    bitmask while this runs (it needs the token read back from the step before, which this takes on the device)."""
    B = batch.tokens.shape[0]
    rows = jnp.arange(B, dtype=jnp.int32)
    slots = jnp.where(batch.active, slot_of(batch.page_table, batch.positions, kv.page_size),
                      SCRATCH_PAGE * kv.page_size)
    return model.forward(cfg, ops, params, kv, batch.tokens, batch.positions, slots, rows, batch.page_table, rows,
                         decode=True, unroll=unroll)


def decode_sample(n_top: int, greedy: bool, method: str, state: SamplerState, batch: DecodeBatch, logits: jax.Array,
                  bitmask: jax.Array):
    """A constrained decode step's second dispatch: `decode_forward`'s logits sampled under the host's bitmask
    [B, ceil(V / 32)] int32. Returns what a one-step `decode_steps` returns but the KV cache: (state, the batch
    advanced one step, tokens [1, B], logprobs [1, B], emitted [1, B], top values [1, B, n_top], top ids [1, B, n_top])."""
    carried = (batch.tokens, batch.positions, batch.step_index, batch.remaining, batch.active)
    state, carried, outs = _decode_sampled(state, batch, logits, carried, n_top, greedy, method, bitmask)
    return (state, batch.replace(**dict(zip(CARRIED, carried))), *(o[None] for o in outs))



def verify_step(cfg: ModelConfig, ops: ModuleType, n_top: int, params: dict, kv: KVCache, state: SamplerState,
                batch: VerifyBatch, greedy: bool = False, attention: str = "paged", method: str = "sort",
                capture: tuple[int, ...] = ()):
    """A mixed step in which each sequence scores Q rows: its last token's and those after each of its drafts
    (num_drafts of them; a sequence without drafts, a plain decode or a prompt chunk, scores one row as
    mixed_step samples it). The drafts are accepted or rejected on the device (sampling.rejection.verify:
    greedy rows keep the drafts equal to the target's argmax; sampled rows by rejection sampling, so the output
    follows the target's distribution), and the tokens they lead to are counted into the penalty state. A
    structured-output step's batch carries a bitmask [B * Q, ceil(V / 32)]: row b * Q + j, sequence b's row j's
    allowed tokens.
    attention: "paged" (ragged rows), or "verify" (every sequence Q rows in order: ops.verify_attention).
    method: sampling.sample's, for the sampled rows.
    Returns (kv, state, accepted drafts [B], tokens [B, Q] (the first accepted + 1 are emitted), logprobs [B, Q],
    top values [B, Q, n_top], top ids [B, Q, n_top]; with `capture`, the captured layers' outputs, as mixed_step)."""
    batch = unpacked(batch)
    sb = batch.step
    B, Q = batch.score_rows.shape
    kv, h, *states = model.hidden_states(cfg, ops, params, kv, _step_tokens(state, sb), sb.positions, sb.slot_mapping,
                                         sb.token_seq, sb.page_table, attention=attention, capture=capture,
                                         rope_long=sb.rope_long)
    logits = model.lm_head(cfg, ops, params, h[batch.score_rows.reshape(B * Q)])
    pm, oc = _gather_rows(state, sb.state_row)
    masks = None if sb.bitmask is None else sb.bitmask.reshape(B, Q, -1)   # structured output: one a scored row
    accepted, tokens, logprobs = verify(logits.reshape(B, Q, -1), batch.drafts, batch.num_drafts, sb.sampling,
                                        sb.step_index, pm, oc, greedy_only=greedy, method=method, bitmask=masks)
    emitted = sb.emits[:, None] & (jnp.arange(Q)[None, :] <= accepted[:, None])
    rows = jnp.where(emitted, sb.state_row[:, None], state.output_counts.shape[0] - 1)   # the rest: scratch row
    state = state.replace(output_counts=state.output_counts.at[rows, tokens].add(1))
    top_v, top_i = top_logprobs(logits, n_top)
    return (kv, state, accepted, tokens, logprobs, top_v.reshape(B, Q, n_top), top_i.reshape(B, Q, n_top), *states)
