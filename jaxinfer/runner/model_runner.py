"""ModelRunner: parameters and KV arrays on the device, one compiled step per shape bucket.

Two jitted step kinds, both with the KV cache and sampler state donated:
- `mixed`: a ragged batch of T tokens (prompt chunks and single decode tokens) for up to B
  sequences; samples the next token of the sequences that emit.
- `decode`: `decode_steps` decode steps for B sequences inside one dispatch (a `lax.scan`
  carrying tokens, positions and done flags), so the host is off the critical path.
All buckets are compiled by `warmup()`; afterwards no request triggers a compilation.
"""

from __future__ import annotations

import functools
import time
import warnings
from types import ModuleType
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxinfer.model import transformer as model
from jaxinfer.runner.batch import StepBatch
from jaxinfer.model.config import ModelConfig
from jaxinfer.runner.executable_cache import ExecutableCache
from jaxinfer.model.kv_cache import SCRATCH_PAGE, KVCache, slot_of
from jaxinfer.sampling.sampling import SamplingArrays, filter_pays, sample, top_logprobs
from jaxinfer.runner.transfer import Packed, to_device, to_device_packed, unpacked


@flax.struct.dataclass
class SamplerState:
    """Per-sequence penalty state, one row per running-sequence slot plus a scratch row (last)."""

    prompt_mask: jax.Array     # bool [rows, V]: token occurs in the prompt
    output_counts: jax.Array   # int32 [rows, V]: times the token was generated
    # int32 [rows]: the token a mixed step last sampled for the row, for a step launched before the
    # host has read it back (StepBatch.from_state)
    last_tokens: jax.Array

    @staticmethod
    def allocate(rows: int, vocab: int) -> "SamplerState":
        return SamplerState(jnp.zeros((rows, vocab), bool), jnp.zeros((rows, vocab), jnp.int32),
                            jnp.zeros((rows,), jnp.int32))


@flax.struct.dataclass
class DecodeBatch:
    """B sequences in the decode phase; each adds one token per inner step."""

    tokens: jax.Array          # int32 [B], last token (its K/V not yet cached)
    positions: jax.Array       # int32 [B], position of that token
    page_table: jax.Array      # int32 [B, P]
    state_row: jax.Array       # int32 [B]
    step_index: jax.Array      # int32 [B], index of the token to generate next
    remaining: jax.Array       # int32 [B], tokens it may still generate
    stop_ids: jax.Array        # int32 [B, S], -1 padded
    active: jax.Array          # bool [B]
    sampling: SamplingArrays


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
               batch: StepBatch, greedy: bool = False, attention: str = "paged", method: str = "branch"):
    """Prompt chunks and decode tokens together.
    Returns (kv, state, tokens [B], logprobs [B], top values [B, n_top], top ids [B, n_top]).
    greedy: every sampled row is greedy (argmax only: no branch whose predicate the GPU runtime must
    read back mid-step, so the call returns at once, as a decode dispatch's does). method: sample's.
    attention: "paged", or for a step that is one sequence's prompt, "fresh" (from position 0) or
    "prefixed" (a chunk after its cached prefix): model.hidden_states. Such a step carries one sequence, so
    it samples its first row alone (the outputs padded back to B): the sampler's cost grows with its rows
    (the sort over 152k ids: 0.18 ms at 1 row, 2.3 ms at 64 on the H200). The engine hands it a one-row
    batch (Runner.sampled_rows), whose page table is one row. batch: a StepBatch, or one packed
    into a single buffer (transfer.to_device_packed: split here, one argument instead of ~20)."""
    batch = unpacked(batch)
    rows = _sampled_batch(batch, attention)
    kv, logits = model.forward(cfg, ops, params, kv, _step_tokens(state, batch), batch.positions, batch.slot_mapping,
                               batch.token_seq, batch.page_table, rows.sample_index, attention=attention)
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
                            batch.page_table, 0, head_layers, attention=attention)


def mixed_tail(cfg: ModelConfig, ops: ModuleType, n_top: int, head_layers: int, params: dict, kv: KVCache,
               state: SamplerState, batch: StepBatch, x: jax.Array, greedy: bool = False, attention: str = "paged",
               method: str = "branch"):
    """The rest of a split mixed step: layers head_layers.. on mixed_head's x, the LM head and the sampling.
    Returns what mixed_step returns."""
    batch = unpacked(batch)
    rows = _sampled_batch(batch, attention)
    kv, x = model.run_layers(cfg, ops, params, kv, x, batch.positions, batch.slot_mapping, batch.token_seq,
                             batch.page_table, head_layers, cfg.num_layers, attention=attention)
    h = model.final_norm(cfg, ops, params, x)
    return _sampled(kv, state, batch, rows, model.lm_head(cfg, ops, params, h[rows.sample_index]), n_top, greedy,
                    method)


class SplitStep:
    """A mixed step as two executables called back to back: mixed_head (the embedding and the first
    `head_layers` layers) and mixed_tail (the other layers and the sampling), each taking only its own
    layers' matrices. Called as a step is, (params, kv, state, batch). On the H200 the device started a 1k
    prompt's step only near the end of its one graph's launch (~1-1.7 ms after the call: 338 kernels); split,
    it can start on the head's small graph while the host launches the tail's (twenty-third session)."""

    PARTS = ("/head", "/tail")

    def __init__(self, cfg: ModelConfig, ops: ModuleType, n_top: int, head_layers: int, greedy: bool,
                 attention: str, method: str, wrap=None):
        self.cfg, self.head_layers = cfg, head_layers
        self.head = jax.jit(functools.partial(mixed_head, cfg, ops, head_layers, attention), donate_argnums=(1,))
        tail = functools.partial(mixed_tail, cfg, ops, n_top, head_layers, greedy=greedy, attention=attention,
                                 method=method)
        self.tail = jax.jit(wrap(tail) if wrap else tail, donate_argnums=(1, 2))
        self._split = (None, None, None)

    def split_params(self, params: dict) -> tuple[dict, dict]:
        """(the head's parameters, the tail's): each without the other's layer matrices (None in their
        place) or arrays it does not read (computed once per parameter tree)."""
        if self._split[0] is not params:
            k, layers = self.head_layers, params["layers"]
            head, tail = dict(params), dict(params)
            if isinstance(layers, (list, tuple)):   # split layers: each part its own matrices
                head["layers"] = [lp if i < k else None for i, lp in enumerate(layers)]
                tail["layers"] = [None if i < k else lp for i, lp in enumerate(layers)]
            for name in ("final_norm", "lm_head"):
                head.pop(name, None)
            if not self.cfg.tie_embeddings:
                tail.pop("embed", None)
            tail.pop("pos_embed", None)
            self._split = (params, head, tail)
        return self._split[1], self._split[2]

    def parts(self, params: dict, kv: KVCache, state: SamplerState, batch) -> list[tuple[str, Any, tuple]]:
        """(name suffix, jitted function, its arguments) of each part, for compiling them apart."""
        head, tail = self.split_params(params)
        x = jax.eval_shape(self.head, head, kv, state, batch)[1]
        return [(self.PARTS[0], self.head, (head, kv, state, batch)),
                (self.PARTS[1], self.tail, (tail, kv, state, batch, x))]

    def __call__(self, params: dict, kv: KVCache, state: SamplerState, batch, head=None, tail=None):
        """head, tail: the parts' compiled executables (default: the jitted functions)."""
        head_params, tail_params = self.split_params(params)
        kv, x = (head or self.head)(head_params, kv, state, batch)
        return (tail or self.tail)(tail_params, kv, state, batch, x)


def _sampled_batch(batch: StepBatch, attention: str) -> StepBatch:
    """The rows a mixed step samples: all of a paged step's, a one-sequence ("fresh", "prefixed") step's first."""
    return batch if attention == "paged" else _first_row(batch)


def _first_row(batch: StepBatch) -> StepBatch:
    """The batch with its per-sequence sampling fields cut to the first sequence's."""
    one = lambda x: x[:1]
    return batch.replace(sample_index=one(batch.sample_index), emits=one(batch.emits), state_row=one(batch.state_row),
                         step_index=one(batch.step_index), sampling=jax.tree.map(one, batch.sampling))


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
                                batch.token_seq, batch.page_table)
    logits = model.lm_head(cfg, ops, params, h)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logp, batch.next_tokens[:, None], axis=-1)[:, 0]
    return (kv, *_sample_rows(logits[batch.sample_index], n_top, state, batch), target,
            *top_logprobs(logits, n_top))


def _sample_rows(logits: jax.Array, n_top: int, state: SamplerState, batch: StepBatch, greedy: bool = False,
                 method: str = "branch"):
    rows = batch.state_row
    pm, oc = _gather_rows(state, rows)
    tokens, logprobs = sample(logits, batch.sampling, batch.step_index, pm, oc, greedy_only=greedy, method=method)
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
        pm, oc = _gather_rows(state, batch.state_row)
        new, logprobs = sample(logits, batch.sampling, step_index, pm, oc, greedy_only=greedy, method=method)
        state = _count(state, batch.state_row, new, active)
        remaining = remaining - active.astype(jnp.int32)
        stopped = jnp.any(new[:, None] == batch.stop_ids, axis=1) | (remaining <= 0)
        emitted = active
        step = active.astype(jnp.int32)
        carry = (kv, state, jnp.where(active, new, tokens), positions + step, step_index + step,
                 remaining, active & ~stopped)
        return carry, (new, logprobs, emitted, *top_logprobs(logits, n_top))

    init = (kv, state, batch.tokens, batch.positions, batch.step_index, batch.remaining, batch.active)
    (kv, state, *carry), outs = jax.lax.scan(one, init, None, length=n_steps)
    return (kv, state, batch.replace(**dict(zip(CARRIED, carry))), *outs)


def bucket_of(batch: StepBatch | DecodeBatch | Packed) -> int:
    """A batch's bucket: its leading size (tokens of a mixed step, rows of a decode dispatch)."""
    return batch.field_shape("tokens")[0] if isinstance(batch, Packed) else batch.tokens.shape[0]


def _bucket_key(name: str, batch) -> tuple[str, int]:
    """Which executable runs `batch`: the step's name and the batch's bucket."""
    return name, bucket_of(batch)


def _sampler_suffix(greedy: bool, sampler: str | None) -> str:
    """A step's name part for its sampling variant: "-greedy", "-plain", "-plain-notop" (decode), "-filter",
    "-filter-p", or "" (the sorting one)."""
    return "-greedy" if greedy else f"-{sampler}" if sampler else ""


def _decode_name(greedy: bool, n_steps: int, sampler: str | None = None) -> str:
    return f"decode{_sampler_suffix(greedy, sampler)}-{n_steps}"


def _outputs_on_host(step):
    """The step with its outputs after (kv, state) moved to pinned host memory inside the executable."""
    def on_host(*args):
        kv, state, *outs = step(*args)
        return (kv, state, *jax.device_put(outs, jax.memory.Space.Host))
    on_host.__name__ = "mixed_step"   # the executable's name in traces, as without the move
    return on_host


def _mixed_name(greedy: bool, sampler: str | None, attention: str) -> str:
    return f"mixed{_sampler_suffix(greedy, sampler)}" + ("" if attention == "paged" else f"-{attention}")


# DecodeBatch fields that a decode dispatch advances; its successor can start from them on device.
CARRIED = ("tokens", "positions", "step_index", "remaining", "active")


def pow2_buckets(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


class ModelRunner:
    """Owns the device state (params, KV cache, sampler state) and the compiled steps."""

    def __init__(self, cfg: ModelConfig, params: dict, ops: ModuleType, *, num_pages: int, page_size: int,
                 max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, steps_per_decode: int = 8,
                 token_buckets: list[int] | None = None, unroll_layers: bool = False, max_logprobs: int = 20,
                 prompt_logprobs: bool = False, executable_cache: ExecutableCache | None = None,
                 short_decode: tuple[int, int] = (0, 1), kv_dtype=None, greedy_mixed: bool = False,
                 fresh_prompt_min_tokens: int = 0, prefixed_chunks: bool = False, plain_sampling: bool = False,
                 mixed_outputs_on_host: bool = False, prompt_head_layers: int = 0):
        """short_decode: (max batch, steps): batch buckets up to max batch run dispatches of that many
        decode steps, the others `steps_per_decode`. kv_dtype: the KV cache's (default the model's).
        greedy_mixed: also compile a greedy-only mixed step per token bucket ("mixed-greedy").
        fresh_prompt_min_tokens > 0: also the variants of "mixed" and "mixed-greedy" for a step that is one
        fresh prompt ("mixed-fresh", "mixed-greedy-fresh"), for the token buckets of at least that many
        tokens (below, the paged kernel was measured faster); with prefixed_chunks, also their variants for a
        step that is one sequence's chunk after its cached prefix ("mixed-prefixed", ...), for the same buckets.
        plain_sampling: the sampling (not greedy-only) steps come in four variants the host picks between
        (sampling.sampler_for), none with a device-side conditional: "-plain", "-filter" and "-filter-p" (no
        sort over the vocabulary) and the sorting one. Without it, one sampling variant skips the sort behind a
        conditional when every row is greedy. mixed_outputs_on_host: the mixed steps' outputs after the KV
        cache and sampler state (tokens, logprobs, ...) are placed in pinned host memory by the step itself.
        prompt_head_layers > 0: the one-sequence prompt steps ("-fresh", "-prefixed") run as SplitStep, their
        first prompt_head_layers layers in an executable of their own."""
        self.cfg, self.params, self.ops = cfg, params, ops
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.pages_per_seq = -(-max_model_len // page_size)
        self.steps_per_decode = steps_per_decode
        self.token_buckets = sorted(set(token_buckets or []) | {max_num_batched_tokens}) if token_buckets else \
            pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens)
        self.batch_buckets = pow2_buckets(1, max_num_seqs)
        self.kv = KVCache.allocate(cfg, num_pages, page_size, kv_dtype)
        self.state = SamplerState.allocate(max_num_seqs + 1, cfg.vocab_size)
        self.scratch_row = max_num_seqs
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.device_wait_seconds = 0.0   # time the host spent blocked on the device (read-backs, waits)
        self.warmup_breakdown: dict[str, float] = {}
        self.short_decode = short_decode
        self.fresh_prompt_min_tokens = fresh_prompt_min_tokens
        # The compiled steps by name, each called as steps[name](params, kv, state, batch). Each step has
        # a greedy-only variant (decode always, mixed with greedy_mixed) for batches that are all greedy and
        # ask for no top logprobs (the host knows): no sampling and no top-k over the vocabulary (0.1 ms a
        # step at 152k, H200). The sampling variants: (greedy, sampler, sample's method) of each.
        samplers = [(False, None, "sort"), (False, "plain", "plain"), (False, "filter", "filter"),
                    (False, "filter-p", "filter-p")] if plain_sampling \
            else [(False, None, "branch")]
        self.steps = {}
        # Decode also has "-plain-notop": the plain sampler for batches that want no top logprobs (a top-20
        # over the vocabulary costs ~0.08 ms a step at batch 1, more than the sampler), as greedy-only has.
        notop = [(False, "plain-notop", "plain")] * plain_sampling
        for n in {self.decode_steps_for(b) for b in self.batch_buckets}:
            for greedy, sampler, method in samplers + notop + [(True, None, "branch")]:
                n_top = 0 if greedy or sampler == "plain-notop" else max_logprobs
                self.steps[_decode_name(greedy, n, sampler)] = jax.jit(
                    functools.partial(decode_steps, cfg, ops, n, unroll_layers, n_top, greedy, method=method),
                    donate_argnums=(1, 2))
        # "-fresh" / "-prefixed": the variants of a step that is one sequence's prompt (model.hidden_states)
        # (none of a filter variant where sampler_for never picks one: too few sampled rows)
        for attention in ("paged",) + ("fresh",) * (fresh_prompt_min_tokens > 0) + ("prefixed",) * prefixed_chunks:
            for greedy, sampler, method in samplers + [(True, None, "branch")] * greedy_mixed:
                if sampler in ("filter", "filter-p") and not filter_pays(self.sampled_rows(attention), sampler):
                    continue
                n_top = 0 if greedy else max_logprobs
                wrap = _outputs_on_host if mixed_outputs_on_host else None
                if attention != "paged" and 0 < prompt_head_layers < cfg.num_layers:
                    self.steps[_mixed_name(greedy, sampler, attention)] = SplitStep(
                        cfg, ops, n_top, prompt_head_layers, greedy, attention, method, wrap)
                    continue
                step = functools.partial(mixed_step, cfg, ops, n_top, greedy=greedy, attention=attention,
                                         method=method)
                self.steps[_mixed_name(greedy, sampler, attention)] = jax.jit(wrap(step) if wrap else step,
                                                                              donate_argnums=(1, 2))
        if prompt_logprobs:
            self.steps["mixed-prompt-logprobs"] = jax.jit(
                functools.partial(mixed_step_prompt_logprobs, cfg, ops, max_logprobs), donate_argnums=(1, 2))
        self._init_row = jax.jit(init_row, donate_argnums=(0,))
        # What the steps are built from besides their arguments: the executable cache's key.
        self._settings = repr((cfg, getattr(ops, "name", getattr(ops, "__name__", None)), unroll_layers,
                               max_logprobs, plain_sampling, mixed_outputs_on_host, prompt_head_layers))
        self.executable_cache = executable_cache
        self._executables: dict[tuple[str, int], Any] = {}   # (step name, bucket) -> compiled at warm-up

    def decode_steps_for(self, batch_bucket: int) -> int:
        """Decode steps in one dispatch of a batch of this bucket."""
        max_batch, steps = self.short_decode
        return steps if batch_bucket <= max_batch else self.steps_per_decode

    def token_bucket(self, n: int) -> int:
        return next(b for b in self.token_buckets if b >= n)

    def batch_bucket(self, n: int) -> int:
        return next(b for b in self.batch_buckets if b >= n)

    def start_sequence(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Reset the sampler row of a sequence that (re)enters the batch."""
        ids = np.zeros(self.max_model_len, np.int32)
        tokens = (prompt_ids + output_ids)[: self.max_model_len]
        ids[: len(tokens)] = tokens
        self.state = self._init_row(self.state, *to_device((np.int32(row), ids, np.int32(len(prompt_ids)),
                                                            np.int32(len(tokens)))))

    def run_mixed(self, batch: StepBatch, prompt_logprobs: bool = False, greedy: bool = False,
                  attention: str = "paged", sampler: str | None = None) -> tuple[np.ndarray, ...]:
        """-> tokens [B], logprobs [B], top logprob values [B, K], top ids [B, K] (numpy); with
        prompt_logprobs also next-token logprobs [T] and top values, ids [T, K] of every row. greedy
        (every row argmax, no top logprobs wanted; needs the runner built with greedy_mixed): K = 0. sampler
        ("plain", "filter" or "filter-p", as sampling.sampler_for gives; needs plain_sampling): the variant
        without the sort."""
        # Without plain_sampling, the sampling step's call returns only once the device has chosen the
        # sampling branch (its predicate is read back), i.e. after most of the step: that time counts as
        # waiting on the device too.
        return self.fetch(self.launch_mixed(batch, prompt_logprobs, greedy, attention, sampler))

    def has_one_sequence_step(self, tokens: int) -> bool:
        """Whether a step of this many tokens that is one sequence's prompt runs a "-fresh" (or, if
        compiled, "-prefixed") variant."""
        return 0 < self.fresh_prompt_min_tokens <= self.token_bucket(tokens)

    def launch_mixed(self, batch: StepBatch, prompt_logprobs: bool = False, greedy: bool = False,
                     attention: str = "paged", sampler: str | None = None) -> tuple:
        """Start a mixed step: its outputs on the device (as run_mixed returns them, not yet read back).
        On a GPU a variant with the sampling branch (no plain_sampling) blocks until the branch is chosen.
        attention "fresh" / "prefixed" (where has_one_sequence_step, without prompt_logprobs): the batch is
        one sequence's prompt, from position 0 / after its cached prefix."""
        name = "mixed-prompt-logprobs" if prompt_logprobs else _mixed_name(greedy, sampler, attention)
        t0 = time.perf_counter()
        self.kv, self.state, *out = self._call(name, batch)
        self.device_wait_seconds += time.perf_counter() - t0
        return tuple(out)

    def fetch(self, arrays) -> tuple[np.ndarray, ...]:
        """Read device arrays back, counting the time spent waiting in `device_wait_seconds`. (Polling the
        arrays' readiness first measured nothing on the H200: bench/NOTES.md, twenty-fourth session.)"""
        t0 = time.perf_counter()
        out = tuple(jax.device_get(list(arrays)))   # the copies start together, not one after another
        self.device_wait_seconds += time.perf_counter() - t0
        return out

    def wait(self, arrays) -> None:
        """Block until device arrays are computed (no read-back), counted as `fetch` counts."""
        t0 = time.perf_counter()
        jax.block_until_ready(arrays)
        self.device_wait_seconds += time.perf_counter() - t0

    def launch_decode(self, batch: DecodeBatch, greedy: bool = False,
                      sampler: str | None = None) -> tuple[DecodeBatch, tuple[jax.Array, ...]]:
        """Start a decode dispatch without waiting for it: (the advanced batch, on device; outputs,
        on device: tokens, logprobs, emitted [n, B], top values, top ids [n, B, K]). greedy: every
        active row has temperature 0 and wants no top logprobs (then K = 0). sampler: as run_mixed's."""
        name = _decode_name(greedy, self.decode_steps_for(batch.tokens.shape[0]), sampler)
        self.kv, self.state, advanced, *out = self._call(name, batch)
        return advanced, tuple(out)

    def _call(self, name: str, batch: StepBatch | DecodeBatch):
        """Run a step on (params, kv, state, batch): its executable from warm-up for the batch's bucket,
        else the jitted step (which compiles an unseen shape)."""
        step = self.steps[name]
        if isinstance(step, SplitStep):
            return step(self.params, self.kv, self.state, batch,
                        *(self._executables.get(_bucket_key(name + part, batch)) for part in SplitStep.PARTS))
        args = (self.params, self.kv, self.state, batch)
        exe = self._executables.get(_bucket_key(name, batch))
        if exe is not None:
            try:
                return exe(*args)
            except TypeError as e:   # the arguments' types differ from warm-up's: checked before running
                warnings.warn(f"step {name}: {e}; using the jitted step")
                del self._executables[_bucket_key(name, batch)]
        return self.steps[name](*args)

    def compiled(self, name: str, batch: StepBatch | DecodeBatch) -> list[tuple[str, Any]]:
        """The step's executables for the batch's bucket, warm-up's, else compiled now (benches): [(name, compiled)],
        two for a SplitStep (name + "/head", name + "/tail"), one otherwise."""
        return [(name + suffix, self._executables.get(_bucket_key(name + suffix, batch)) or fn.lower(*args).compile())
                for suffix, fn, args in self._parts(name, batch)]

    def _parts(self, name: str, batch: StepBatch | DecodeBatch) -> list[tuple[str, Any, tuple]]:
        """What compiles apart for a step at the batch's bucket: [(name suffix, jitted function, arguments)], a
        SplitStep's two parts, else the step itself (suffix "")."""
        step = self.steps[name]
        if isinstance(step, SplitStep):
            return step.parts(self.params, self.kv, self.state, batch)
        return [("", step, (self.params, self.kv, self.state, batch))]

    def run_decode(self, batch: DecodeBatch, greedy: bool = False,
                   sampler: str | None = None) -> tuple[np.ndarray, ...]:
        """launch_decode, then wait for its outputs (numpy)."""
        return self.fetch(self.launch_decode(batch, greedy, sampler)[1])

    # Padded, inert batches: used for warm-up and as the template the engine fills in.
    def empty_mixed(self, T: int, rows: int | None = None) -> dict[str, np.ndarray]:
        """A mixed step's host arrays for T tokens and `rows` sequences (default max_num_seqs; a one-sequence
        prompt step's batch has 1: its page table is one row, not max_num_seqs x pages_per_seq)."""
        B = rows or self.max_num_seqs
        return dict(
            tokens=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
            slot_mapping=np.full(T, SCRATCH_PAGE * self.page_size, np.int32), token_seq=np.zeros(T, np.int32),
            next_tokens=np.zeros(T, np.int32), from_state=np.zeros(T, bool),
            page_table=self.empty_page_table(B), query_start=np.zeros(B + 1, np.int32),
            sample_index=np.zeros(B, np.int32), emits=np.zeros(B, bool),
            state_row=np.full(B, self.scratch_row, np.int32),
            step_index=np.zeros(B, np.int32),
        )

    def empty_page_table(self, B: int) -> np.ndarray:
        return np.full((B, self.pages_per_seq), SCRATCH_PAGE, np.int32)

    def empty_decode(self, B: int, n_stop: int = 8) -> dict[str, np.ndarray]:
        return dict(
            tokens=np.zeros(B, np.int32), positions=np.zeros(B, np.int32),
            page_table=self.empty_page_table(B),
            state_row=np.full(B, self.scratch_row, np.int32), step_index=np.zeros(B, np.int32),
            remaining=np.zeros(B, np.int32), stop_ids=np.full((B, n_stop), -1, np.int32),
            active=np.zeros(B, bool),
        )

    def bucket_calls(self) -> list[tuple[str, StepBatch | DecodeBatch]]:
        """Every compiled step with an inert batch of its bucket: (name in `steps`, batch); the step is
        called as steps[name](params, kv, state, batch)."""
        calls = []
        for t in self.token_buckets:
            for attention in ("paged", "fresh"):   # "prefixed" takes fresh's one-row batch
                one = attention != "paged"
                if one and not self.has_one_sequence_step(t):
                    continue
                rows = self.sampled_rows(attention)
                batch = to_device_packed(StepBatch(**self.empty_mixed(t, rows),
                                                   sampling=SamplingArrays.from_params([], [], rows)))
                calls += [(name, batch) for name in self.steps if name.startswith("mixed") and
                          name.endswith(("-fresh", "-prefixed")) == one]
        for b in self.batch_buckets:
            batch = to_device(DecodeBatch(**self.empty_decode(b), sampling=SamplingArrays.from_params([], [], b)))
            n = self.decode_steps_for(b)
            calls += [(name, batch) for name in self.steps if name.startswith("decode") and name.endswith(f"-{n}")
                      and (filter_pays(b, "filter-p") or "-filter-p-" not in name)]   # sampler_for sorts there
        return calls

    def sampled_rows(self, attention: str) -> int:
        """Rows a mixed step of this attention carries and samples (mixed_step): a one-sequence step its one."""
        return self.max_num_seqs if attention == "paged" else 1

    def warmup(self, progress: bool = True, threads: int = 1, compile: bool = True) -> float:
        """Compile every bucket now (inert batches touch only the scratch page) and run each once.
        Returns seconds.

        With an executable cache, a step found there is loaded (no tracing, no lowering); the others
        are traced and lowered one by one on this thread and compiled on `threads` threads side by
        side (XLA compiles outside the GIL; the unrolled steps of a large model take seconds each),
        then saved. Where the time went is left in `warmup_breakdown` (seconds): `load` (from the
        executable cache), `lower` (tracing and lowering, summed), `compile` (summed over the
        threads), `compile_wall` (the parallel phase, lowering included) and `first_runs`. compile=False:
        only the scratch row's sampler state; each step compiles when first called with a bucket's shape."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        t0 = time.perf_counter()
        self.start_sequence(self.scratch_row, [0], [])
        if not compile:
            return time.perf_counter() - t0
        calls = self.bucket_calls()
        # what compiles apart: (executable's name, batch, jitted function, arguments)
        units = [(name + suffix, batch, fn, args) for name, batch in calls
                 for suffix, fn, args in self._parts(name, batch)]
        cache = self.executable_cache
        keys = [cache.key(name, self._settings, args) if cache else None for name, _, _, args in units]
        spent = dict(load=0.0, lower=0.0, compile=0.0, compile_wall=0.0, first_runs=0.0)
        bar = tqdm(total=len(units), desc="compiling steps", unit="step", disable=not progress, leave=False)

        def load(i):
            exe = cache.load(keys[i])
            if exe is not None:
                self._executables[_bucket_key(*units[i][:2])] = exe
            return exe is not None

        def compile_and_save(i, lowered):
            t = time.perf_counter()
            exe = lowered.compile()
            self._executables[_bucket_key(*units[i][:2])] = exe
            seconds = time.perf_counter() - t
            if cache:
                cache.save(keys[i], exe)
            return seconds

        with ThreadPoolExecutor(max(1, threads)) as pool:
            t1 = time.perf_counter()
            loaded = list(pool.map(load, range(len(units)))) if cache else [False] * len(units)
            spent["load"] = time.perf_counter() - t1
            bar.update(sum(loaded))
            t1 = time.perf_counter()
            futures = []
            for i, (_, _, fn, args) in enumerate(units):
                if not loaded[i]:
                    t = time.perf_counter()
                    lowered = fn.lower(*args)
                    spent["lower"] += time.perf_counter() - t
                    futures.append(pool.submit(compile_and_save, i, lowered))
            for f in as_completed(futures):
                try:
                    spent["compile"] += f.result()
                except Exception as e:  # the first run below compiles it again, through the jit
                    warnings.warn(f"parallel compilation of a step failed ({type(e).__name__}: {e}); "
                                  "compiling it on the main thread")
                bar.update()
            spent["compile_wall"] = time.perf_counter() - t1
        bar.reset(total=len(calls))
        t1 = time.perf_counter()
        for name, batch in calls:
            self.kv, self.state, *out = self._call(name, batch)
            jax.block_until_ready(out)
            bar.update()
        spent["first_runs"] = time.perf_counter() - t1
        bar.close()
        self.warmup_breakdown = spent
        return time.perf_counter() - t0
