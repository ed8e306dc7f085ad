"""Structured output on the host: a request's constraint (params.StructuredOutput) compiled by llguidance
into a matcher that writes the next token's bitmask and advances with each token the request emits.

llguidance (Rust, no Python dependencies) rather than xgrammar, which pulls in torch and transformers: this
package must not import either. The bitmask is int32 [rows, ceil(V / 32)], bit j of word i allowing token
32 i + j (llguidance's and xgrammar's layout), sized for the MODEL's vocabulary V: ids past the
tokenizer's (padding rows of the embedding) are never allowed. JSON is compiled without free whitespace
(``{"a":1}``; a schema's ``x-guidance`` options override that): a small or random model left free to
emit blanks may never close the object.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxinfer.errors import JaxinferError
from jaxinfer.sampling.params import StructuredOutput
from jaxinfer.text import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = '{"type": "object"}'


class StructuredOutputError(JaxinferError, ValueError):
    """A JSON schema, regex or grammar the grammar engine cannot compile; the message says why."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words a bitmask row takes for this vocabulary."""
    return -(-vocab_size // 32)


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask [rows, bitmask_words(vocab_size)] allowing every token (all bits set)."""
    return np.full((rows, bitmask_words(vocab_size)), -1, np.int32)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (for tests and debugging)."""
    bits = (bitmask_row.astype(np.int32)[:, None] >> np.arange(32, dtype=np.int32)) & 1
    return np.nonzero(bits.reshape(-1)[:vocab_size])[0]


class Matcher:
    """One request's grammar state: `fill` its next token's bitmask row, `advance` with each emitted token."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, C-contiguous)."""
        llnp.fill_next_token_bitmask(self._m, bitmask, row)

    def advance(self, token: int) -> bool:
        """Consume an emitted token; False if the grammar does not allow it (the matcher is then in error)."""
        return self._m.consume_token(int(token))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (drafts) the grammar allows in a row from here; the matcher does not move."""
        return self._m.validate_tokens([int(t) for t in tokens]) if tokens else 0

    @property
    def finished(self) -> bool:
        """No token but end-of-sequence may follow: the output is complete (or the matcher is in error)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is complete (more may still follow)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        """Why the matcher stopped on an error ('' if it did not)."""
        return self._m.get_error() if self._m.is_error() else ""


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary. Grammars are cached by constraint, so a
    repeated schema compiles once; each request gets its own Matcher."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 threads: int | None = None):
        """vocab_size: the model's (config vocab_size; at least the tokenizer's). eos_token_ids: the tokens
        the grammar allows once the output is complete (the engine's end-of-sequence ids)."""
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"the model's vocabulary ({vocab_size}) is smaller than its tokenizer's "
                             f"({tokenizer.vocab_size})")
        if not eos_token_ids:
            raise ValueError("structured output needs an end-of-sequence token")
        self.vocab_size = vocab_size
        self._tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                           eos_token=[int(t) for t in eos_token_ids])
        self._executor: llguidance.LLExecutor | None = None
        self._threads = threads

    @functools.lru_cache(maxsize=256)
    def grammar(self, constraint: StructuredOutput) -> str:
        """The llguidance grammar of a constraint, checked against the tokenizer; StructuredOutputError if it
        does not compile."""
        kind = constraint.kind
        try:
            if kind == "json":
                g = llguidance.LLMatcher.grammar_from_json_schema(constraint.json, defaults=JSON_OPTIONS)
            elif kind == "json_object":
                g = llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
            elif kind == "regex":
                g = llguidance.LLMatcher.grammar_from_regex(constraint.regex)
            elif kind == "choice":
                g = llguidance.grammar_from("choice", list(constraint.choice))
            else:
                g = llguidance.grammar_from("grammar", constraint.grammar)
        except Exception as e:   # a ValueError for text that is not JSON; anything else is still the input's fault
            raise StructuredOutputError(f"structured {kind}: {_first_line(str(e))}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(g, self._tok)
        if is_error:
            raise StructuredOutputError(f"structured {kind}: {_first_line(messages[0])}")
        return g

    def matcher(self, constraint: StructuredOutput) -> Matcher:
        """A fresh matcher at the start of the output; StructuredOutputError if the constraint does not compile."""
        m = llguidance.LLMatcher(self._tok, self.grammar(constraint), log_level=0)
        if m.is_error():
            raise StructuredOutputError(f"structured {constraint.kind}: {_first_line(m.get_error())}")
        return Matcher(m)

    def fill(self, bitmask: np.ndarray, rows: Sequence[tuple[Matcher, int]]) -> None:
        """Write each (matcher, row)'s next-token mask into bitmask, the rows on llguidance's threads."""
        if len(rows) == 1:
            rows[0][0].fill(bitmask, rows[0][1])
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._threads)
        llnp.fill_next_token_bitmask_par(self._executor, [(m._m, row) for m, row in rows], bitmask)


    def fill_with_drafts(self, bitmask: np.ndarray, rows: Sequence[tuple[Matcher, int, Sequence[int]]]) -> None:
        """For each (matcher, row, drafts): write into bitmask[row + j] the mask of the token after drafts[:j], for
        j = 0..len(drafts) (speculative decoding: one mask a verified position), on llguidance's threads. The drafts
        must be ones the grammar allows (`Matcher.valid_prefix`); the matchers are left where they were."""
        drafted = [(m._m, row, [int(t) for t in d]) for m, row, d in rows if len(d)]
        if len(drafted) < len(rows):   # llguidance's drafted fill takes no empty drafts
            self.fill(bitmask, [(m, row) for m, row, d in rows if not len(d)])
        if drafted:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(self._threads)
            llnp.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)


def _first_line(message: str) -> str:
    """llguidance's messages append the parser's state dump; the reason is the first lines."""
    return message.split("\n<state>")[0].strip()
