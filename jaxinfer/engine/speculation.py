"""The engine's side of speculative decoding: which drafts each step verifies, and the counts behind the
acceptance figures (`/metrics`, `generate`'s summary).

A `Speculator` asks its proposer (spec/: n-gram, draft model, DFlash) for up to k_max tokens per generating
sequence, keeps each sequence's acceptance estimate (spec.adaptive), and cuts the proposals to the k that
pays for this batch (0: a plain decode dispatch instead of a verify step).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxinfer.engine.scheduler import Sequence
from jaxinfer.settings import MAX_SPECULATIVE_TOKENS, EngineConfig
from jaxinfer.spec.adaptive import Acceptance, choose_drafts, rows_nearly_free
from jaxinfer.spec.ngram import NgramProposer
from jaxinfer.spec.proposer import Proposer

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine


@dataclasses.dataclass
class SpeculationStats:
    verify_steps: int = 0      # verify steps with at least one draft
    drafted: int = 0           # drafted tokens verified
    accepted: int = 0          # of them accepted
    emitted: int = 0           # tokens the verify steps emitted (accepted drafts and the target's own)
    sequence_verifies: int = 0   # (sequence, verify step) pairs with drafts
    chained_steps: int = 0     # verify steps launched before their predecessor was read back
    chained_rows_dropped: int = 0   # their rows whose predecessor did not go as assumed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gains per verify that carried its drafts (accepted drafts + the target's token)."""
        return (self.accepted + self.sequence_verifies) / self.sequence_verifies if self.sequence_verifies else 0.0


RATE_MEMORY = 0.7     # weight of the past in the measured rates, a step
PROBE_EVERY = 32      # decode dispatches after which drafts are tried again where trying did not pay


class Speculator:
    """The drafts each step verifies. Two checks decide: the cost model of spec.adaptive (acceptance against the
    rows a step computes), and what was measured in this engine: the output tokens a second of verify steps and of
    decode dispatches at each batch size, so that where verifying turned out slower (a large batch, drafts that
    fail) the engine decodes without drafts, trying a verify step again now and then.

    Trying is not free either: a decode dispatch is chained behind the one in flight (launched before that one is
    read back) only when no drafts are wanted, since proposals need its tokens. A try that finds nothing to verify
    costs one unchained dispatch, so each batch bucket keeps when it last tried (`tried`): after a try without
    drafts the next waits a number of decode dispatches that doubles up to PROBE_EVERY. Where the cost model says
    verify rows are not nearly free (spec.adaptive.rows_nearly_free) and no verify step has yet measured faster than
    decoding, verifying starts only from a measurement: decode dispatches are measured first, then one try (a probe),
    and after a probe without drafts the next waits PROBE_EVERY dispatches."""

    def __init__(self, proposer: Proposer, k_max: int, adaptive: bool = True):
        self.proposer, self.k_max, self.adaptive = proposer, k_max, adaptive
        self._rates: dict[tuple[str, int], float] = {}    # (verify | decode, batch bucket) -> tokens a second
        self._since_try: dict[int, int] = {}   # batch bucket -> decode dispatches since drafts were last tried there
        self._wait: dict[int, int] = {}        # batch bucket -> decode dispatches to let pass before the next try
        # a proposer whose state comes from the target's verify steps (DFlash) drafts at every decode step
        self.min_drafts = 1 if getattr(proposer, "needs_every_step", False) else 0
        self._acceptance: dict[int, Acceptance] = {}
        self._chains: dict[int, Acceptance] = {}   # per sequence: how often a chained step's assumption held
        self.stats = SpeculationStats()

    def drafts(self, seqs: list[Sequence], room: int | None = None,
               bucket: int | None = None) -> dict[Sequence, list[int]]:
        """{sequence: its drafts} for the generating `seqs` of the next step (empty: decode without drafts).
        room: the most drafted tokens the step can take in all; bucket: the batch's (measured rates)."""
        if not seqs:
            return {}
        # Would drafting pay even if every sequence had k_max drafts? If not, skip proposing.
        if not self.may_draft(seqs, bucket):
            self.idle(seqs)
            return {}
        return self._propose(seqs, room)

    def _propose(self, seqs: list[Sequence], room: int | None) -> dict[Sequence, list[int]]:
        """The proposals for `seqs`, cut to the chosen k and to `room` (drafts, once may_draft has said yes)."""
        rates = [self._acceptance.setdefault(s.request_id, Acceptance()).rate for s in seqs]
        proposals = self.proposer.propose(seqs, self.k_max)
        k = max(choose_drafts(rates, [len(p) for p in proposals], self.k_max, self.adaptive), self.min_drafts)
        out = {}
        for seq, p in zip(seqs, proposals):
            p = p[:k]
            if room is not None:
                p = p[:max(room, 0)]
                room -= len(p)
            if p:
                out[seq] = p
        if not out:
            self.idle(seqs)
        return out

    def may_draft(self, seqs: list[Sequence], bucket: int | None = None) -> bool:
        """Whether the next step over `seqs` might verify drafts (asked before their proposals exist, and before a
        decode dispatch is chained). bucket: the batch's bucket, whose measured rates and tries may rule it out."""
        if self.min_drafts > 0:
            return True
        if self.adaptive and bucket is not None and not self._worth_trying(bucket):
            return False
        rates = [self._acceptance.setdefault(s.request_id, Acceptance()).rate for s in seqs]
        return choose_drafts(rates, [self.k_max] * len(seqs), self.k_max, self.adaptive) > 0

    def would_draft(self, seqs: list[Sequence], bucket: int) -> bool:
        """Whether a verify step would run over `seqs` now, asked before a decode dispatch is chained behind the one in
        flight: may_draft, and where verify rows are not nearly free (a large batch's probe), for a proposer of the
        host's tokens alone (n-gram), drafts that pay on the host's view (one dispatch behind). A probe that finds
        none is recorded (`tried`) and the chain goes on: it costs no unchained dispatch. Small batches stop the
        chain on may_draft alone and propose from the tokens read back."""
        if not self.may_draft(seqs, bucket):
            return False
        if rows_nearly_free(bucket * (self.k_max + 1)) or not getattr(self.proposer, "host_only", False):
            return True
        if self._propose(seqs, None):
            return True
        self.tried(bucket, False)
        return False

    def _worth_trying(self, bucket: int) -> bool:
        """Whether drafts may be tried at this batch bucket now, by what was measured and tried there."""
        since = self._since_try.get(bucket, 0)
        if since < self._wait.get(bucket, 0):
            return False
        verify, decode = self._rates.get(("verify", bucket)), self._rates.get(("decode", bucket))
        if verify is None:   # optimistic only where verify rows are nearly free; else decode first, then probe
            return decode is not None or rows_nearly_free(bucket * (self.k_max + 1))
        if decode is None:   # verify steps measured, decode dispatches not yet: one runs first, so that they compare
            return False
        return verify >= decode or since >= PROBE_EVERY

    def _proven(self, bucket: int) -> bool:
        """Verify steps measured faster than decode dispatches at this bucket, or its verify rows nearly free."""
        verify, decode = self._rates.get(("verify", bucket)), self._rates.get(("decode", bucket))
        if verify is not None and decode is not None:
            return verify >= decode
        return rows_nearly_free(bucket * (self.k_max + 1))

    def tried(self, bucket: int, drafted: bool) -> None:
        """A decode step's try at drafts at this batch bucket: it verified drafts, or found none worth it (it then
        ran as a decode dispatch launched alone)."""
        self._since_try[bucket] = 0
        if drafted:
            self._wait[bucket] = 0
        elif self._proven(bucket):
            self._wait[bucket] = min(max(2 * self._wait.get(bucket, 0), 1), PROBE_EVERY)
        else:
            self._wait[bucket] = PROBE_EVERY

    def measured(self, kind: str, bucket: int, tokens: int, seconds: float) -> None:
        """A verify step's or decode dispatch's output tokens and wall time at a batch bucket."""
        if seconds <= 0 or tokens <= 0:
            return
        key = (kind, bucket)
        rate = tokens / seconds
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else RATE_MEMORY * old + (1 - RATE_MEMORY) * rate
        if kind == "decode":
            self._since_try[bucket] = self._since_try.get(bucket, 0) + 1

    def chain_rate(self, seq: Sequence) -> float:
        """The sequence's estimated chance that a chained verify step's assumption holds (its previous step accepts
        every draft and the guess after them is right): decayed counts with a prior of one in two."""
        return self._chains.setdefault(seq.request_id, Acceptance()).rate

    def record_chain(self, seq: Sequence, held: bool) -> None:
        """A verify step's outcome for chaining: a chained row kept or dropped, or (unchained) all drafts accepted."""
        self._chains.setdefault(seq.request_id, Acceptance()).record(1, int(held))

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self._acceptance.setdefault(seq.request_id, Acceptance()).record(drafted, accepted)
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.sequence_verifies += drafted > 0

    def idle(self, seqs: list[Sequence]) -> None:
        """A step without drafts: the sequences' old evidence fades, so speculation is tried again later."""
        for seq in seqs:
            self._acceptance.setdefault(seq.request_id, Acceptance()).record(0, 0)

    def forget(self, seq: Sequence) -> None:
        self._acceptance.pop(seq.request_id, None)
        self._chains.pop(seq.request_id, None)
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(seq)


DEFAULT_SPECULATIVE_TOKENS = 4


def resolve_speculative(config: EngineConfig) -> EngineConfig:
    """The config with speculative decoding's defaults filled in: the number of drafted tokens (4; a DFlash
    drafter's block size less one)."""
    if not config.speculative:
        if config.num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens needs speculative (ngram, draft:DIR or dflash:DIR)")
        return config
    k = config.num_speculative_tokens
    if k is None:
        k = DEFAULT_SPECULATIVE_TOKENS
        if config.speculative.startswith("dflash:"):
            from jaxinfer.spec.dflash_config import load_dflash_config
            k = min(load_dflash_config(config.speculative.partition(":")[2]).block_size - 1, MAX_SPECULATIVE_TOKENS)
    return dataclasses.replace(config, num_speculative_tokens=k)


def make_proposer(config: EngineConfig, engine: Engine) -> Proposer:
    """The proposer `config.speculative` names, for the engine's target model."""
    kind, _, path = config.speculative.partition(":")
    if kind == "ngram":
        return NgramProposer()
    if kind == "draft":
        from jaxinfer.spec.draft_model import DraftModelProposer
        return DraftModelProposer(path, engine.cfg, engine.tokenizer, config)
    if kind == "dflash":
        from jaxinfer.spec.dflash_proposer import DFlashProposer
        return DFlashProposer(path, engine.cfg, config)
    raise ValueError(f"speculative must be ngram, draft:DIR or dflash:DIR, got {config.speculative!r}")
