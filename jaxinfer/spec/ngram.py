"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for the largest n from max_n down to min_n that occurs. No model; host side, in numpy.

A copy-heavy continuation (an edit of the prompt, code, a quoted passage) repeats long runs of earlier tokens,
and these proposals then verify many tokens a step; open text rarely matches, and the proposer offers nothing
(the step is a plain decode). On the host because it is cheap there: the candidates are the earlier positions
of the last token (one vectorised comparison over the sequence), each extended backwards n - 1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxinfer.spec.proposer import DraftedSequence

MAX_N = 4   # the longest suffix matched (vLLM's prompt_lookup_max is typically 3-5)
MIN_N = 2   # the shortest: one token matches too often in open text to be worth a verify row


def ngram_proposal(tokens: Sequence[int] | np.ndarray, k: int, max_n: int = MAX_N, min_n: int = MIN_N) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    min_n..max_n tokens; [] when none occurs."""
    t = np.asarray(tokens, dtype=np.int64)
    L = len(t)
    if k <= 0 or L < min_n + 1:
        return []
    # earlier ends of a match: positions p < L - 1 holding the last token (p + 1 is what would follow)
    ends = np.flatnonzero(t[: L - 1] == t[L - 1])
    best = None
    for d in range(1, max_n):
        if d >= min_n and ends.size:
            best = ends[-1], d          # a suffix of d tokens matches here (the latest such)
        ends = ends[ends - d >= 0]
        ends = ends[t[ends - d] == t[L - 1 - d]] if L - 1 - d >= 0 else ends[:0]
    if ends.size and max_n >= min_n:
        best = ends[-1], max_n
    if best is None:
        return []
    end = int(best[0])
    return t[end + 1: end + 1 + k].tolist()


class NgramProposer:
    """Proposals from each sequence's own tokens (`seq.tokens`: prompt and output so far)."""

    name = "ngram"
    host_only = True   # reads only the host's tokens: the engine may ask it while a dispatch is in flight

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: Sequence[DraftedSequence], k: int) -> list[list[int]]:
        return [ngram_proposal(seq.tokens, k, self.max_n, self.min_n) for seq in seqs]
