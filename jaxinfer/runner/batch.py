"""The pytrees a step consumes: StepBatch (a mixed step's ragged tokens), VerifyBatch (one whose sequences
also verify drafted tokens), DecodeBatch (a decode dispatch's sequences) and SamplerState (per-sequence penalty state on the device), in the layout of DESIGN.md.

T (tokens) and B (sequences) are padded to compiled buckets; padding tokens write to the scratch
page and padding sequences are never sampled from.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer.sampling.sample import SamplingArrays


@flax.struct.dataclass
class StepBatch:
    # per token [T]
    tokens: jax.Array          # int32
    positions: jax.Array       # int32, position of the token in its sequence
    slot_mapping: jax.Array    # int32, where its K/V row is written
    token_seq: jax.Array       # int32, its sequence's row in the per-sequence arrays
    next_tokens: jax.Array     # int32, the prompt token that follows it (for prompt logprobs; else 0)
    from_state: jax.Array      # bool, the token is the one the previous mixed step sampled for its
                               # sequence, not yet read back (SamplerState.last_tokens); `tokens` ignored
    # per sequence [B]
    page_table: jax.Array      # int32 [B, P]
    query_start: jax.Array     # int32 [B + 1], first token row of each sequence
    sample_index: jax.Array    # int32, token row whose logits are sampled
    emits: jax.Array           # bool, this step produces the sequence's next token
    state_row: jax.Array       # int32, row of the sequence in the sampler state
    step_index: jax.Array      # int32, index of the token being generated (for the seeded PRNG)
    sampling: SamplingArrays
    bitmask: jax.Array | None = None   # int32 [B, ceil(V / 32)]: structured output's allowed tokens; None: no mask
    # bool [B]: LongRoPE's long factors for every token of the sequence (its prompt is longer than the original
    # length: rotary.takes_long_factors); None for a model without LongRoPE (its steps' pytree stays as it was)
    rope_long: jax.Array | None = None


@flax.struct.dataclass
class VerifyBatch:
    """A speculative verify step: a mixed step's ragged tokens in which a verifying sequence's chunk is its last
    token followed by its drafts, so that one target pass scores all of them. Q (static: the arrays' width) is
    the most rows a sequence scores, one more than the most drafts."""

    step: StepBatch            # its sample_index is unused: score_rows[:, 0] takes its place
    score_rows: jax.Array      # int32 [B, Q]: the token row whose logits follow draft j (j = 0: the last token)
    drafts: jax.Array          # int32 [B, Q - 1]: the drafted tokens (the chunk's rows after the last token)
    num_drafts: jax.Array      # int32 [B]: how many of them count (0: a plain decode or prompt chunk)

    @property
    def tokens(self) -> jax.Array:
        """The step's token rows (its bucket)."""
        return self.step.tokens


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

# DecodeBatch fields that a decode dispatch advances; its successor can start from them on device.
CARRIED = ("tokens", "positions", "step_index", "remaining", "active")
