"""Incremental detokenization: generated token ids to text deltas as they arrive."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxinfer.text.tokenizer import Tokenizer, clean_up_tokenization

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas as they arrive.

    The vLLM scheme: decode a short window of tokens before the new ones (prefix_offset..read_offset)
    and the same window extended by the new tokens, and emit the difference. The window gives
    SentencePiece decoders the context to turn a leading "▁" into a space, and text is held back
    while it ends in U+FFFD (an incomplete UTF-8 character from byte tokens). Each token costs two
    decodes of a few tokens, not a re-decode of everything.

    Without a prompt, the deltas concatenate to `tokenizer.decode(generated_ids)`; with one, to the
    part of `decode(prompt_ids + generated_ids)` after `decode(prompt_ids)`, so the first generated
    word gets its leading space. (A prompt that ends inside a character counts only up to its last
    whole character.) Call `flush()` at the end for any held-back text. This holds for valid
    UTF-8 output; a model that emits invalid byte sequences gets U+FFFD in the deltas, placed
    as the window saw them.
    """

    _PROMPT_WINDOW = 5  # prompt tokens of context, as vLLM
    _MAX_LOOKBACK = 8  # extra tokens to step back so a window never starts mid-character
    _TRIM_AT = 1024  # drop consumed ids past this many, keeping memory O(window)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, *,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer.backend
        self._skip = skip_special_tokens
        self._clean_up = tokenizer.cleans_up_spaces
        ids = [int(i) for i in (prompt_ids or [])[-(self._PROMPT_WINDOW + 2 * self._MAX_LOOKBACK):]]
        self._ids = ids
        self._prefix_offset, self._read_offset = self._initial_window(len(ids))
        self._shown: int | None = None  # len(decode(window before read_offset)), cached

    def _initial_window(self, n: int) -> tuple[int, int]:
        """(prefix_offset, read_offset) for a prompt tail of n ids: both on character boundaries.

        The window must not start mid-character (byte-fallback decoders turn a whole run of byte
        tokens into U+FFFD then). A prompt that ends inside a character leaves its last tokens
        unread: their text comes out with the first generated tokens, once the character is whole.
        Boundaries are found by looking for a window that decodes without U+FFFD.
        """
        for read in range(n, max(n - 4, 0) - 1, -1):
            if read == 0:
                return 0, 0
            start = max(read - self._PROMPT_WINDOW, 0)
            for prefix in range(start, max(start - self._MAX_LOOKBACK, 0) - 1, -1):
                if _REPLACEMENT_CHAR not in self._decode(prefix, read):
                    return prefix, read
        return max(n - self._PROMPT_WINDOW, 0), n  # U+FFFD in the prompt text itself: plain window

    def _decode(self, start: int, end: int | None = None) -> str:
        text = self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)
        return clean_up_tokenization(text) if self._clean_up else text

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one or more new token ids; return the newly completed text (maybe "")."""
        if isinstance(token_ids, int):
            return self._step(token_ids)
        return "".join(self._step(int(t)) for t in token_ids)

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        new_text = self._decode(self._prefix_offset)
        shown = self._shown_len()
        if len(new_text) <= shown or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or an incomplete character at the end: hold back
        delta = new_text[shown:]
        self._shown = None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > self._TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def flush(self) -> str:
        """Text still held back (an unfinished character decodes to U+FFFD), and reset the hold."""
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._prefix_offset)
        shown = self._shown_len()
        self._prefix_offset, self._read_offset, self._shown = self._read_offset, len(self._ids), None
        return new_text[shown:]

    def _shown_len(self) -> int:
        """Length of the window's text already emitted (or prompt); cached until the window moves."""
        if self._shown is None:
            self._shown = len(self._decode(self._prefix_offset, self._read_offset))
        return self._shown
