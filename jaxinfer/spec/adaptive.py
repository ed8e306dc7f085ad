"""How many drafted tokens a step verifies (0: a plain decode), chosen per step from the batch and the measured
acceptance, so that speculation does not make a loaded engine slower than decoding without it.

Each sequence keeps a running estimate of the chance that a drafted token is accepted (counts with exponential
forgetting and a prior of one accept in two tries). Verifying k drafts that each survive with chance a yields
1 + a + a^2 + ... + a^k tokens in expectation. The step's cost is modelled from the rows it computes: a batched
step costs about what a one-row step costs while its GEMMs stay memory-bound (below KNEE_ROWS rows on the H200:
the weights' bytes dominate), and grows linearly beyond; a verify step also pays VERIFY_OVERHEAD over a decode
step (it is one step a dispatch, read back before the next is built unless chained (n-gram), where decode
dispatches run several steps and overlap the host). The k with the most expected tokens per unit of cost wins; ties go to the smaller k.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KNEE_ROWS = 192          # rows where a step of Qwen3-4B's shape turns compute-bound on the H200 (GEMM rate / bandwidth)
VERIFY_OVERHEAD = 1.15   # a verify step's cost over a decode step's at equal rows (host sync, the acceptance)
FORGET = 0.8             # weight of the past in the acceptance counts, per verify step


def step_cost(rows: int) -> float:
    """A step's cost in units of a one-row step."""
    return max(1.0, rows / KNEE_ROWS)


def rows_nearly_free(rows: int) -> bool:
    """Whether a step of this many rows costs about what a one-row step does (its GEMMs still memory-bound)."""
    return step_cost(rows) <= 1.0


@dataclasses.dataclass
class Acceptance:
    """One sequence's drafted and accepted counts, decayed."""

    drafted: float = 0.0
    accepted: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + 1.0) / (self.drafted + 2.0)

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted = FORGET * self.drafted + drafted
        self.accepted = FORGET * self.accepted + accepted


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verify of k drafts yields in expectation (the target's own token included)."""
    return sum(rate ** i for i in range(k + 1))


def choose_drafts(rates: list[float], proposed: list[int], k_max: int, adaptive: bool = True) -> int:
    """The drafts a step verifies per sequence (each sequence at most what it proposed): 0..k_max. rates: each
    sequence's acceptance estimate; proposed: how many drafts each has. Without `adaptive`, k_max whenever any
    sequence has a draft. (In numpy over k and the sequences at once: it runs before every step, ~10 us at any
    batch where a loop took 0.1-0.2 ms at 16-64 sequences.)"""
    if not any(proposed):
        return 0
    if not adaptive:
        return k_max
    B = len(rates)
    drafts = np.minimum(np.arange(k_max + 1)[:, None], np.asarray(proposed)[None, :])    # [k, sequence]
    # expected_tokens(rate, d) for every d: 1 + rate + ... + rate^d
    gains = np.cumsum(np.asarray(rates, np.float64)[None, :] ** np.arange(k_max + 1)[:, None], axis=0)
    tokens = np.take_along_axis(gains, drafts, axis=0).sum(axis=1)
    value = (tokens / (VERIFY_OVERHEAD * np.maximum(1.0, (B + drafts.sum(axis=1)) / KNEE_ROWS))).tolist()
    best, best_k = B / step_cost(B), 0
    for k in range(1, k_max + 1):
        if value[k] > best * (1 + 1e-9):
            best, best_k = value[k], k
    return best_k
