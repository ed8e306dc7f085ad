"""Logprobs in the two OpenAI shapes, from the engine's per-token logprobs and top-k lists.

A token is shown as its own text and, for chat, its UTF-8 bytes. Bytes are exact: byte-level BPE
tokens (GPT-2, Llama 3, Qwen) map back through the byte-to-unicode table, SentencePiece byte
tokens (`<0xE2>`) are that byte, and `▁` is a space. A token that is part of a character shows
as its bytes decoded with replacement characters, as OpenAI does.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from jaxinfer.text import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    dec = tokenizer.backend.decoder
    name = type(dec).__name__
    return name == "ByteLevel" or (name == "Sequence" and "ByteLevel" in repr(dec))


class TokenText:
    """Token id -> (text, bytes), cached."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._special = set(tokenizer.backend.get_added_tokens_decoder()) if hasattr(
            tokenizer.backend, "get_added_tokens_decoder") else set()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return "", []
        if token_id in self._special:
            raw = piece.encode()
        elif self._byte_level and all(c in _BYTE_DECODER for c in piece):
            raw = bytes(_BYTE_DECODER[c] for c in piece)
        elif (m := _BYTE_TOKEN.fullmatch(piece)) is not None:
            raw = bytes([int(m.group(1), 16)])
        else:
            raw = piece.replace("\u2581", " ").encode()
        return raw.decode("utf-8", errors="replace"), list(raw)


def _finite(lp: float) -> float:
    """JSON has no -inf: a token the model gave (numerically) no probability shows -9999, as vLLM."""
    return lp if lp > -9999.0 else -9999.0   # also maps NaN


def chat_logprobs(tt: TokenText, ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[Sequence[tuple[int, float]]] | None, k: int) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` entries for these tokens."""
    out = []
    for j, (tid, lp) in enumerate(zip(ids, logprobs)):
        text, raw = tt(tid)
        entries = []
        if top is not None and k:
            for t, v in top[j][:k]:
                ttext, traw = tt(t)
                entries.append({"token": ttext, "logprob": _finite(v), "bytes": traw})
        out.append({"token": text, "logprob": _finite(lp), "bytes": raw, "top_logprobs": entries})
    return out


def completion_logprobs(tt: TokenText, ids: Sequence[int], logprobs: Sequence[float],
                        top: Sequence[Sequence[tuple[int, float]]] | None, k: int, offset: int) -> dict[str, Any]:
    """`choices[i].logprobs` of /v1/completions for these tokens; text offsets start at `offset`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for j, (tid, lp) in enumerate(zip(ids, logprobs)):
        text, _ = tt(tid)
        tokens.append(text)
        token_logprobs.append(_finite(lp))
        d: dict[str, float] = {}
        if top is not None:
            for t, v in top[j][:k]:
                d.setdefault(tt(t)[0], _finite(v))
        d.setdefault(text, _finite(lp))   # the sampled token is always listed, as vLLM does
        tops.append(d)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
