"""StepBatch: the arrays one step of the model consumes, in the ragged layout of DESIGN.md.

T (tokens) and B (sequences) are padded to compiled buckets; padding tokens write to the scratch
page and padding sequences are never sampled from.
"""

from __future__ import annotations

import flax.struct
import jax

from jaxinfer.sampling.sampling import SamplingArrays


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
