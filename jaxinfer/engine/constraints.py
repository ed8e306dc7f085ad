"""The engine's side of structured output: a matcher for each constrained request (sampling.structured), the
bitmask of a step's rows built on the host before the step is launched, and each emitted token fed back.

A constrained sequence's next mask depends on the token it just emitted, so the host must see that token
before the step that samples the next one: such a sequence runs one decode step a dispatch, in two parts (the
forward pass, launched before the previous token is read back, then the sampling under the masks made
meanwhile: Engine._sample_masked) and is not planned into a prompt step ahead of its read-back. With speculative
decoding its drafts are cut at the first token the grammar refuses and a verify step carries one mask a scored
position (the matcher advanced through the drafts before it: `draft_bitmask`); the matcher then consumes only the
tokens the step accepts. Unconstrained batches are untouched: their steps carry no bitmask and compile no mask.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.sampling.params import StructuredOutput
from jaxinfer.text import Tokenizer

if TYPE_CHECKING:   # llguidance is imported on the first constrained request: an engine without one runs without it
    from jaxinfer.sampling.structured import GrammarCompiler, Matcher

log = logging.getLogger("jaxinfer.engine")


class Constraints:
    """Matchers for one engine's constrained requests. The grammar compiler (llguidance's view of the tokenizer:
    about 1.4 s for a 152k vocabulary) is built on the first constrained request."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Seq[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self.mask_seconds = 0.0   # host time building bitmasks, summed
        self.masks = 0            # bitmask rows filled
        # Bitmasks kept, by step kind ("decode", "verify") and row count: two buffers taken in turn (filling one
        # while the other may still be on its way to the device), each with the rows llguidance wrote last (reset to
        # all ones when not written again)
        self._buffers: dict[tuple[str, int], list] = {}

    def matcher(self, constraint: StructuredOutput) -> Matcher:
        """A new request's matcher; StructuredOutputError (a ValueError) if its constraint does not compile."""
        return self._compiled().matcher(constraint)

    def check(self, constraint: StructuredOutput) -> None:
        """Compile a constraint (cached for its requests' matchers); StructuredOutputError if it does not compile.
        The server calls it off the engine's thread, before queueing the request."""
        self._compiled().grammar(constraint)

    def allow_all(self, rows: int) -> np.ndarray:
        """A bitmask of `rows` rows allowing every token (sampling.structured.allocate_bitmask's)."""
        return np.full((rows, -(-self.vocab_size // 32)), -1, np.int32)

    def _compiled(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer (this engine was started without one)")
        if self._compiler is None:
            from jaxinfer.sampling.structured import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._compiler

    def bitmask(self, matchers: Seq[Matcher | None], rows: int, reuse: bool = False) -> np.ndarray | None:
        """The bitmask [rows, ceil(V / 32)] of a step whose row b samples for matchers[b] (None: unconstrained,
        all tokens allowed, as are the padding rows past them); None when no row is constrained. reuse: written into
        one of two buffers kept for this row count, taken in turn (saves allocating and setting ~1.2 MB a step at
        152k tokens and 64 rows): the caller must be done with the mask two calls later (a decode step's sampling,
        read back before the step after next fills its mask)."""
        filled = [(m, b) for b, m in enumerate(matchers) if m is not None]
        if not filled:
            return None
        t0 = time.perf_counter()
        if reuse:
            mask = self._reused("decode", rows, {b for _, b in filled})
        else:
            mask = self.allow_all(rows)
        self._compiler.fill(mask, filled)
        self.mask_seconds += time.perf_counter() - t0
        self.masks += len(filled)
        return mask

    def draft_bitmask(self, rows: Seq[tuple[Matcher, int, Seq[int]]], total: int) -> np.ndarray:
        """A verify step's bitmask [total, ceil(V / 32)]: for each (matcher, first row, drafts), row first + j holds
        the mask of the token after drafts[:j] (j = 0..len(drafts)); every other row allows every token. The drafts
        must be ones the grammar allows (cut with `allowed_drafts`). Written into a kept buffer (the verify step's
        batch is copied into a packed buffer of its own at once): ~6 MB at 64 rows of 5 and 152k tokens."""
        t0 = time.perf_counter()
        mask = self._reused("verify", total, {first + j for _, first, d in rows for j in range(len(d) + 1)})
        self._compiler.fill_with_drafts(mask, rows)
        self.mask_seconds += time.perf_counter() - t0
        self.masks += sum(len(d) + 1 for _, _, d in rows)
        return mask

    def _reused(self, kind: str, rows: int, constrained: set[int]) -> np.ndarray:
        """The next buffer of `rows` rows for steps of this kind, its rows that llguidance wrote last time and will not
        write now set to all ones."""
        pair = self._buffers.get((kind, rows))
        if pair is None:
            pair = self._buffers[kind, rows] = [[self.allow_all(rows), set()], [self.allow_all(rows), set()], 0]
        pair[2] ^= 1
        mask, written = pair[pair[2]]
        stale = written - constrained
        if stale:
            mask[sorted(stale)] = -1
        pair[pair[2]][1] = constrained
        return mask


def allowed_drafts(matcher: Matcher, drafts: list[int]) -> list[int]:
    """A constrained request's drafts cut before the first token its grammar refuses (what follows could never be
    accepted under the masks)."""
    return drafts[:matcher.valid_prefix(drafts)]


def advance(matcher: Matcher, token: int) -> str | None:
    """Feed an emitted token to its request's matcher: the finish reason it implies ("stop" where the grammar
    is complete and only the end of the sequence may follow; "abort" where the grammar refuses a token its mask
    allowed, which ends this request alone), else None."""
    if not matcher.advance(token):
        log.warning("structured output: the grammar refused token %d, which its mask allowed: %s", token,
                    matcher.error.split("\n")[0])
        return "abort"
    return "stop" if matcher.finished else None
