"""The scheduler: which sequences run, which tokens each one computes in the next step, which pages
hold them.

- Continuous batching: sequences join (from the waiting queue, oldest first) whenever a sampler row
  and the pages for their prompt are free, and leave as soon as they finish.
- Mixed steps: while any running sequence has prompt tokens left, a step carries one decode token
  for every generating sequence plus prompt chunks under the token budget, so a long prompt
  never stalls the others. Otherwise the step is a multi-step decode dispatch.
- Prefix caching: a sequence joining takes the cached pages of the longest prefix of its full
  blocks (never its last token, whose logits are needed) and computes only the rest; every block
  it completes is registered for later sequences (paging.py). With LongRoPE, a prompt longer than the original
  length takes the long factors for every key (model/rotary.py): its blocks chain from a salt of their own, so
  that no sequence takes pages computed with the other factors.
- Pages are taken as sequences grow. When none are left, the youngest running sequence is
  preempted: its pages are released (they stay cached), and it goes back to the front of the
  waiting queue to be recomputed later, ending with the same tokens it would have had.
- Sliding windows: where every layer attends over a window (`window`, the largest), the pages entirely
  behind the window of a sequence's next token are released as it advances (they stay cached, as a
  finished sequence's do) and its page-table entries for them become the scratch page.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from typing import Any, Callable

from jaxinfer.engine.paging import PageAllocator, block_hashes
from jaxinfer.model.kv_cache import SCRATCH_PAGE
from jaxinfer.sampling import SamplingParams


@dataclasses.dataclass(eq=False)
class Sequence:
    """Host state of one request."""

    request_id: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new: int
    stop_ids: list[int]
    detok: Any = None                 # IncrementalDetokenizer, or None without a tokenizer
    stopper: Any = None               # StopStringMatcher
    grammar: Any = None               # structured output's Matcher (engine/constraints.py), or None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # per prompt token: None for the first, else (logprob, top [(id, logprob)]) when asked for
    prompt_logprobs: list = dataclasses.field(default_factory=lambda: [None])
    text: str = ""
    pages: list[int] = dataclasses.field(default_factory=list)   # page j: positions j * page_size..; freed: scratch
    hashes: list[int] = dataclasses.field(default_factory=list)   # of its registered full blocks
    row: int = -1                     # sampler-state row while running
    num_computed: int = 0             # tokens whose K/V are in the cache
    admitted: int = -1                # admission order (the youngest is preempted first)
    preemptions: int = 0
    finish_reason: str | None = None
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefilling(self) -> bool:
        """True while tokens other than the last generated one still lack K/V (prompt, or a recompute)."""
        return self.num_computed < len(self.tokens) - (1 if self.output_ids else 0)


LONG_ROPE_SALT = "rope:long"   # the hash chain's start for a LongRoPE sequence whose keys take the long factors
TRIM_FROM = 512   # token buckets from which a step's excess over a bucket is left for a later step


@dataclasses.dataclass
class Plan:
    """The next step: `mixed` with (sequence, tokens to compute) pairs, or `decode` of `steps` steps."""

    kind: str
    chunks: list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, pages: PageAllocator, page_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 decode_steps: int, on_start: Callable[[Sequence], None], prefix_caching: bool = True,
                 token_buckets: list[int] | None = None, window: int = 0, rope_original_length: int = 0):
        self.pages = pages
        self.rope_original_length = rope_original_length   # LongRoPE's (a longer prompt's blocks hashed apart); else 0
        self.window = window              # positions a query sees at most, where every layer has a window; else 0
        self.num_freed_pages = 0          # pages released behind a window (a running count)
        self.token_buckets = sorted(token_buckets or [])
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_steps = decode_steps
        self.on_start = on_start          # called when a sequence (re)joins: reset its sampler row
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_rows = list(range(max_num_seqs))[::-1]
        self._order = itertools.count()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- admission ----
    def _admit(self) -> None:
        ps = self.page_size
        while self.waiting and self.free_rows:
            seq = self.waiting[0]
            tokens = seq.tokens
            # A request for prompt logprobs computes its whole prompt: cached blocks would skip rows.
            cacheable = self.prefix_caching and seq.params.prompt_logprobs is None
            hashes = block_hashes(tokens[: (len(tokens) - 1) // ps * ps], ps, prev=self._salt(seq)) if cacheable else []
            cached = self.pages.lookup(hashes)
            need = -(-len(tokens) // ps) - len(cached)
            if need > self.pages.num_free:
                self.pages.release(cached)
                break
            self.waiting.popleft()
            seq.pages, seq.hashes = cached, hashes[: len(cached)]
            seq.num_computed = len(cached) * ps
            seq.row = self.free_rows.pop()
            seq.admitted = next(self._order)
            self.running.append(seq)
            self.on_start(seq)

    # ---- pages ----
    def _preempt(self, seq: Sequence) -> None:
        self.pages.release(_held(seq.pages))
        seq.pages, seq.hashes, seq.num_computed = [], [], 0
        self.free_rows.append(seq.row)
        seq.row = -1
        seq.preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, n_tokens: int, preempt: bool = True) -> bool:
        """Hold pages for the sequence's first n_tokens, preempting younger sequences if needed (with
        `preempt`; else False when the free pool is short). False when `seq` itself had to be preempted."""
        need = -(-n_tokens // self.page_size) - len(seq.pages)
        if not preempt and need > self.pages.num_free:
            return False
        while need > self.pages.num_free:
            victim = max(self.running, key=lambda s: s.admitted)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages += self.pages.allocate(need)
        return True

    def hold(self, seq: Sequence, n_tokens: int) -> bool:
        """Pages for the sequence's first n_tokens (drafted tokens to verify) if the free pool has them, without
        preempting anyone."""
        return self._reserve(seq, n_tokens, preempt=False)

    def trim(self, seq: Sequence) -> None:
        """Return the pages beyond what the sequence's next decode dispatch needs (those that held drafts)."""
        last = min(len(seq.tokens) - 1 + self.decode_steps, len(seq.prompt_ids) + seq.max_new)
        keep = max(-(-last // self.page_size), -(-seq.num_computed // self.page_size))
        if len(seq.pages) > keep:
            self.pages.release(_held(seq.pages[keep:]))
            del seq.pages[keep:]

    def register_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        full = seq.num_computed // self.page_size
        if self.prefix_caching and full > len(seq.hashes):
            prev = seq.hashes[-1] if seq.hashes else self._salt(seq)
            new = block_hashes(seq.tokens[: full * self.page_size], self.page_size, len(seq.hashes), prev)
            for i, h in enumerate(new, start=len(seq.hashes)):
                if seq.pages[i] != SCRATCH_PAGE:   # (a page freed behind a window is never one not yet registered)
                    self.pages.register(seq.pages[i], h)
            seq.hashes += new

    def _salt(self, seq: Sequence) -> str | None:
        """What a sequence's first block hash chains from: a LongRoPE prompt longer than the original length (every
        key with the long factors) from a salt, others from None."""
        long_prompt = self.rope_original_length and len(seq.prompt_ids) > self.rope_original_length
        return LONG_ROPE_SALT if long_prompt else None

    def free_behind_window(self, seq: Sequence) -> int:
        """Release the sequence's pages that lie entirely behind the window of its next token (every position
        below num_computed - window + 1: no later query of any layer sees them); their entries become the scratch
        page, which the attention kernels never read for a real row (they start at the window's first position).
        Call after register_blocks, so that they stay in the prefix cache. Returns the pages released."""
        if not self.window:
            return 0
        behind = max(seq.num_computed - self.window + 1, 0) // self.page_size
        gone = _held(seq.pages[:behind])
        if gone:
            self.pages.release(gone)
            seq.pages[:behind] = [SCRATCH_PAGE] * min(behind, len(seq.pages))
            self.num_freed_pages += len(gone)
        return len(gone)

    def release(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves."""
        if seq in self.running:
            self.running.remove(seq)
            self.pages.release(_held(seq.pages))
            self.free_rows.append(seq.row)
            seq.pages, seq.row = [], -1
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # ---- the next step ----
    def schedule(self) -> Plan | None:
        self._admit()
        if not self.running:
            return None
        if any(s.prefilling for s in self.running):
            return self._mixed()
        return self._decode()

    def _mixed(self) -> Plan | None:
        chunks = self._fit_bucket(self._chunks())
        return Plan("mixed", chunks) if chunks else self.schedule()

    def schedule_ahead(self, pending: set[Sequence], busy: set[Sequence] | frozenset = frozenset()) -> Plan | None:
        """The next mixed step, planned while the one in flight runs and before its tokens are read
        back (`_chunks` says what the `pending` sequences, whose next token it samples, do; `busy` ones,
        in a decode dispatch in flight whose token count the host does not know yet, sit it out). It
        never preempts (a sequence that would need it is left out: the step in flight still writes to
        the running sequences' pages); None when no prompt chunk fits, and then the step in flight is
        read back first."""
        self._admit()
        chunks = self._chunks(pending, preempt=False, skip=busy)
        if not any(seq.prefilling for seq, _ in chunks):
            return None
        chunks = self._fit_bucket(chunks)
        return Plan("mixed", chunks) if chunks else None

    def _chunks(self, pending: set[Sequence] | frozenset = frozenset(), preempt: bool = True,
                skip: set[Sequence] | frozenset = frozenset()) -> list[tuple[Sequence, int]]:
        """The token budget shared out, oldest first: one decode token for every generating sequence,
        then prompt chunks. A `pending` sequence (a step in flight samples its next token, which the
        host has not seen) decodes that token, its row reading it on the device (StepBatch.from_state)
        at position len(tokens); it is left out when that token may be its last by length (a stop
        token or string can still end it: its extra token is then dropped)."""
        budget = self.max_num_batched_tokens
        chunks: list[tuple[Sequence, int]] = []
        order = sorted(self.running, key=lambda s: s.admitted)
        for seq in order:   # decodes first
            if budget <= 0 or seq not in self.running or seq in skip:
                continue
            if seq in pending:
                # nor when its next token needs a mask from the token the host has not seen (structured output)
                if len(seq.output_ids) + 1 >= seq.max_new or seq.grammar is not None:
                    continue
                upto = len(seq.tokens) + 1
            elif seq.prefilling:
                continue
            else:
                upto = len(seq.tokens)
            if self._reserve(seq, upto, preempt):
                chunks.append((seq, 1))
                budget -= 1
        for seq in order:
            if seq.prefilling and seq not in pending and budget > 0 and seq in self.running:
                n = min(len(seq.tokens) - seq.num_computed, budget)
                if self._reserve(seq, seq.num_computed + n, preempt):
                    chunks.append((seq, n))
                    budget -= n
        return [(s, n) for s, n in chunks if s in self.running]   # drop any preempted after being chosen

    def _fit_bucket(self, chunks: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """A step runs at the smallest compiled token bucket that holds it, padding included. When its
        tokens pass a bucket b >= TRIM_FROM by at most b / 2 (a newcomer's 1,024-token prompt beside
        one running decode: 1,025 tokens, run at 2,048), the excess waits for a later step: a step of b
        and a small one cost less than one of 2b, on the GPU where a prefill step's time grows with its
        padded size. What waits: if this step completes every prompt in it and the excess is no more
        than its decodes, the youngest decodes (they lose one step; the newcomers' first tokens come
        now, not after one more step); otherwise the last prompt chunks give back the excess."""
        total = sum(n for _, n in chunks)
        lo = max((b for b in self.token_buckets if b <= total), default=0)
        excess = total - lo
        prompt_tokens = sum(n for seq, n in chunks if seq.prefilling)
        if lo < TRIM_FROM or excess == 0 or excess > lo // 2 or excess >= prompt_tokens:
            return chunks
        decodes = [i for i, (seq, _) in enumerate(chunks) if not seq.prefilling]
        completes = all(seq.num_computed + n >= len(seq.tokens) for seq, n in chunks if seq.prefilling)
        if completes and excess <= len(decodes):
            wait = set(decodes[-excess:])   # decodes come oldest first
            return [c for i, c in enumerate(chunks) if i not in wait]
        out = []
        for seq, n in reversed(chunks):
            if seq.prefilling and excess:
                cut = min(n, excess)
                n, excess = n - cut, excess - cut
            if n:
                out.append((seq, n))
        return out[::-1]

    def _decode(self) -> Plan | None:
        for seq in sorted(self.running, key=lambda s: s.admitted):
            if seq in self.running:
                last = min(len(seq.tokens) - 1 + self.decode_steps, len(seq.prompt_ids) + seq.max_new)
                self._reserve(seq, last)
        seqs = sorted(self.running, key=lambda s: s.admitted)
        return Plan("decode", [(s, 1) for s in seqs]) if seqs else self.schedule()


def _held(pages: list[int]) -> list[int]:
    """The pages a sequence holds among its page-table entries (not the scratch page of those freed behind a
    window)."""
    return [p for p in pages if p != SCRATCH_PAGE]
