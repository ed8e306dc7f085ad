"""The engine's verify steps (speculative decoding), as methods of Engine: which drafts a planned step verifies
(`_drafts`), the step itself (`_verify`: built and launched by `_launch_verify`, its accepted tokens appended and
its rejected drafts rolled back by `_collect_verify`), and the captured layer states handed to a DFlash proposer
(`_observe`). Engine (engine.py) calls them from `step` when its Speculator (speculation.py) has drafts.

Chained verify steps (`_chain_verify`, Tuning.chain_verify): a verify step's host work (building its arrays, the
launch, the read-back and the append: ~1.6 ms on the H200 at batch 1) would otherwise run while the device idles,
because the next step's tokens depend on this one's acceptance. So while step N runs, step N + 1 is built as if N
accepts every draft and its next token is the proposer's guess (an n-gram proposes one token past N's drafts:
the guess, then N + 1's drafts), and launched before N is read back. A sequence whose N did not go as assumed
has its N + 1 row dropped on read-back: its K/V writes lie past the committed tokens, where later steps write
again (as rejected drafts' do), and the pages it wrote into are in stream order behind it for any new owner.
Only where nothing else can differ: proposers of the host's tokens (n-gram), no penalties (a dropped row's
tokens are counted into the device's penalty state), no structured output (a row's masks need the tokens before
it on the host), and where the acceptance measured
makes a full accept likely (CHAIN_MIN_CHANCE).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxinfer.engine.constraints import allowed_drafts
from jaxinfer.engine.outputs import StreamDelta
from jaxinfer.engine.scheduler import Sequence
from jaxinfer.model.kv_cache import SCRATCH_PAGE
from jaxinfer.model.rotary import takes_long_factors
from jaxinfer.runner.batch import StepBatch, VerifyBatch
from jaxinfer.runner.transfer import to_device_packed
from jaxinfer.runner.variants import StepVariant, choose_sampler
from jaxinfer.sampling.sample import SamplingArrays

RAGGED_DRAFTS_MAX_BATCH = 4   # the most generating sequences whose drafts ride beside prompt chunks
# The least estimated chance (the batch's mean of Speculator.chain_rate) that a chained verify step's assumption
# holds for it to be chained: a failed guess wastes a device step (~3 ms at batch 1) to save the host's ~1.6 ms, so
# chaining pays above about 1 - 1.6 / 3.
CHAIN_MIN_CHANCE = 0.5


@dataclasses.dataclass
class VerifyInFlight:
    """A verify step launched and not yet read back. assumed: for a chained step, each sequence's tokens it took as
    committed past the host's tokens when built (its previous step's drafts and the guess after them), and
    base: the sequence's token count then; dropped: the sequences whose assumption turned out wrong."""
    chunks: list
    ds: list
    emits: list
    rows: int
    dense: bool
    outs: tuple
    tops: bool
    launched: float
    compiling: float
    build_seconds: float
    assumed: dict = dataclasses.field(default_factory=dict)
    base: dict = dataclasses.field(default_factory=dict)
    dropped: set = dataclasses.field(default_factory=set)
    full: dict = dataclasses.field(default_factory=dict)   # after read-back: whether each row accepted every draft
    drafted: float = 0.0   # when its drafts were proposed (its time runs from then, or from the last read-back)


class _View:
    """A sequence as a proposer sees it with `extra` tokens appended (a chained step's assumption)."""

    def __init__(self, seq: Sequence, extra: list[int]):
        self.request_id, self.prompt_ids = seq.request_id, seq.prompt_ids
        self.output_ids = seq.output_ids + extra
        self.tokens = self.prompt_ids + self.output_ids


class VerifySteps:
    """Engine's speculative steps (a mixin: they read the engine's runner, scheduler, speculator and stats)."""

    def _observe(self, a: dict) -> None:
        """Hand the step's captured layer states (a DFlash drafter's context) to the proposer, with the step's
        positions and slots (host arrays `a`)."""
        if self.runner.captured is not None:
            self.speculator.proposer.observe(self.runner.captured, a["positions"], a["slot_mapping"])
            self.runner.captured = None
    def _drafts(self, plan) -> dict[Sequence, list[int]]:
        """The drafts the planned step verifies, by generating sequence, each within what the sequence may still
        emit and holding pages for its drafts' K/V (no drafts where the free pool is short)."""
        self._drafting_started = time.perf_counter()
        generating = [seq for seq, _ in plan.chunks if not seq.prefilling]
        room = None
        if plan.kind == "mixed":
            room = self.runner.token_buckets[-1] - sum(n for _, n in plan.chunks)
        bucket = self.runner.batch_bucket(max(len(generating), 1))
        if not generating or plan.kind == "mixed" and not self._drafts_beside_prompts(plan, generating) \
                or not self.speculator.may_draft(generating, bucket):
            self.speculator.idle(generating)
            return {}
        for seq in generating:   # a draft model writes its drafts' K/V: pages for them where the pool has some
            self.scheduler.hold(seq, min(len(seq.output_ids) + self.speculator.k_max, seq.max_new) +
                                len(seq.prompt_ids))
        drafts = self.speculator.drafts(generating, room, bucket)
        out = {}
        for seq, d in drafts.items():
            d = d[:seq.max_new - len(seq.output_ids) - 1]   # it emits up to len(d) + 1 tokens
            if seq.grammar is not None:   # structured output: none past the first token its grammar refuses
                d = allowed_drafts(seq.grammar, d)
            if d and self.scheduler.hold(seq, len(seq.prompt_ids) + len(seq.output_ids) + len(d)):
                out[seq] = d
        for seq in generating:   # pages held for drafts that did not come
            if seq not in out:
                self.scheduler.trim(seq)
        if plan.kind == "decode":   # a try in place of a chained decode dispatch: its outcome paces the next
            self.speculator.tried(bucket, bool(out))
        return out

    def _drafts_beside_prompts(self, plan, generating: list[Sequence]) -> bool:
        """Whether a step carrying prompt chunks may verify drafts (a ragged verify step, read back at once). Not
        beside more than RAGGED_DRAFTS_MAX_BATCH generating sequences (their drafts' rows and the lost overlap
        outweigh what they gain at a large batch), and not where prompt steps are launched one ahead of their
        read-back (overlap_mixed) while prompt work follows this step: a verify step would break that chain. Nor
        beside a prompt chunk whose tokens' logprobs were asked for (prompt_logprobs: a verify step scores none)."""
        if len(generating) > RAGGED_DRAFTS_MAX_BATCH:
            return False
        if any(seq.prefilling and seq.params.prompt_logprobs is not None for seq, _ in plan.chunks):
            return False
        if not self.config.tuning.overlap_mixed:
            return True
        s = self.scheduler
        if s.waiting and s.free_rows:
            return False
        planned = {seq: n for seq, n in plan.chunks}
        return not any(seq.prefilling and seq.num_computed + planned.get(seq, 0) < len(seq.tokens)
                       for seq in s.running)

    def _verify(self, chunks: list[tuple[Sequence, int]], drafts: dict[Sequence, list[int]],
                dense: bool) -> list[StreamDelta]:
        """One verify step: each chunk's tokens, a generating sequence's drafts after its last token, all scored
        in one pass; the accepted drafts and the target's next token are appended, the rest rolled back (their
        K/V slots are overwritten later; the pages that held them are returned). dense: every chunk is a
        sequence's decode (a step in place of a decode dispatch), laid out Q rows a sequence for
        ops.verify_attention; otherwise the ragged layout of a mixed step."""
        return self._collect_verify(self._launch_verify(chunks, drafts, dense))

    def _launch_verify(self, chunks: list[tuple[Sequence, int]], drafts: dict[Sequence, list[int]], dense: bool,
                       assumed: dict[Sequence, list[int]] | None = None) -> VerifyInFlight:
        """Build and launch a verify step (see _verify); `assumed` (dense only): tokens each sequence is taken to
        have committed past its host tokens (a chained step)."""
        r, ps = self.runner, self.config.page_size
        t_build = time.perf_counter()
        assumed = assumed or {}
        seqs = [seq for seq, _ in chunks]
        B = len(seqs)
        ds = [drafts.get(seq, ()) for seq in seqs]
        extra = [assumed.get(seq, []) for seq in seqs]
        width = max(r.verify_widths)
        if dense:
            width = min(w for w in r.verify_widths if w > max(map(len, ds)))
        rows = r.batch_bucket(B) if dense else r.max_num_seqs
        used = B * width if dense else sum(n + len(d) for (_, n), d in zip(chunks, ds))
        a = r.empty_verify(rows * width if dense else r.token_bucket(used), rows, width)
        s = a["step"]
        # Each row's fields gathered in Python lists and written once a field: at a batch of 16 the per-sequence
        # numpy writes this replaces took ~0.4 ms; numpy over all rows at once costs more at batch 1.
        tokens, positions, slots, token_seq, score_rows, ends = [], [], [], [], [], []
        page_table, pad, t = s["page_table"], SCRATCH_PAGE * ps, 0
        for b, (seq, n) in enumerate(chunks):
            d, start, pages = ds[b], seq.num_computed + len(extra[b]), seq.pages
            m = n + len(d)
            span = width if dense else m   # rows it takes (dense: width, those past its drafts padding)
            tokens += (seq.tokens + extra[b])[start:start + n] if extra[b] else _tokens_at(seq, start, n)
            tokens += d
            tokens += [0] * (span - m)
            slots += [pages[p // ps] * ps + p % ps for p in range(start, start + m)]
            slots += [pad] * (span - m)
            positions += range(start, start + span)
            token_seq += [b] * span
            score_rows += [t + n - 1 + min(j, len(d)) for j in range(width)]
            page_table[b, :len(pages)] = pages
            if d:
                a["drafts"][b, :len(d)] = d
            t += span
            ends.append(t)
        s["tokens"][:used] = tokens
        s["positions"][:used] = positions
        s["slot_mapping"][:used] = slots
        s["token_seq"][:used] = token_seq
        a["score_rows"][:B] = np.reshape(score_rows, (B, width))
        emits = [seq.num_computed + n >= len(seq.prompt_ids) + len(seq.output_ids) for seq, n in chunks]
        s["emits"][:B] = emits
        s["state_row"][:B] = [seq.row for seq in seqs]
        s["step_index"][:B] = [len(seq.output_ids) + len(x) for seq, x in zip(seqs, extra)]
        if "rope_long" in s:   # LongRoPE: every token of a long prompt takes the long factors (model/rotary.py)
            s["rope_long"][:B] = [takes_long_factors(self.cfg, len(seq.prompt_ids)) for seq in seqs]
        s["query_start"][1:B + 1] = ends
        s["query_start"][B + 1:] = used
        a["num_drafts"][:B] = [len(d) for d in ds]
        params = [seq.params for seq in seqs]
        # structured output: a mask for each of an emitting constrained sequence's scored rows (row b * width + j: the
        # grammar after its drafts[:j]); the matcher moves only with the tokens the step accepts (_append)
        constrained = [(seq.grammar, b * width, ds[b]) for b, (seq, e) in enumerate(zip(seqs, emits))
                       if e and seq.grammar is not None and seq.finish_reason is None]
        bitmask = self.constraints.draft_bitmask(constrained, rows * width) if constrained else None
        batch = to_device_packed(VerifyBatch(step=StepBatch(**s, sampling=self._verify_sampling(seqs, rows),
                                                            bitmask=bitmask), **{
            k: a[k] for k in ("score_rows", "drafts", "num_drafts")}))
        greedy = choose_sampler(params, rows, plain_sampling=False) == "greedy"   # verify steps sample by sorting
        variant = StepVariant("verify", "greedy" if greedy else "sort", "verify" if dense else "paged", width,
                              masked=bitmask is not None)
        tops = any(q.logprobs is not None for q in params)   # top logprobs read back only where asked for
        t0 = time.perf_counter()
        compiling = r.first_call_seconds
        outs = r.launch_verify(batch, variant)
        self._observe(s)
        return VerifyInFlight(chunks, ds, emits, rows, dense, outs, tops, t0, compiling, t0 - t_build,
                              {seq: x for seq, x in zip(seqs, extra) if x},
                              {seq: len(seq.prompt_ids) + len(seq.output_ids) for seq, x in zip(seqs, extra) if x},
                              drafted=self._drafting_started)

    def _collect_verify(self, f: VerifyInFlight, chained: VerifyInFlight | None = None) -> list[StreamDelta]:
        """Read a verify step back: append each emitting sequence's accepted drafts and the target's token, roll
        back the rest; rows in f.dropped are skipped. chained: the step launched behind f, whose rows' pages stay
        held (it writes their K/V; its own read-back trims them)."""
        r = self.runner
        outs = f.outs
        accepted, tokens, logprobs, top_v, top_i = r.fetch(outs) if f.tops else r.fetch(outs[:3]) + (None, None)
        t1 = time.perf_counter()
        compiled = r.first_call_seconds - f.compiling   # a step compiled on first use: not its time
        seconds = t1 - f.launched - compiled
        self.phase_seconds["build"] += f.build_seconds
        self.phase_seconds["run"] += t1 - f.launched
        stats = self.speculator.stats
        stats.verify_steps += 1
        deltas, emitted = [], 0
        for b, ((seq, n), emits_b, acc) in enumerate(zip(f.chunks, f.emits, accepted[:len(f.chunks)].tolist())):
            if seq in f.dropped:   # its previous step did not go as this row assumed
                if seq.finish_reason is None:
                    self.scheduler.trim(seq)
                continue
            if seq.finish_reason == "abort":   # aborted while the step was in flight
                continue
            if not emits_b:
                seq.num_computed += n
                continue
            if f.ds[b]:
                self.speculator.record(seq, len(f.ds[b]), acc)
            f.full[seq] = acc == len(f.ds[b])
            seq.num_computed += n + acc
            deltas.append(self._append(seq, tokens[b, :acc + 1], logprobs[b, :acc + 1],
                                       None if top_v is None else top_v[b, :acc + 1],
                                       None if top_i is None else top_i[b, :acc + 1]))
            emitted += acc + 1
            # a stop among the accepted drafts
            seq.num_computed = min(seq.num_computed, len(seq.prompt_ids) + len(seq.output_ids))
            if seq.finish_reason is not None:
                self._finished[seq.request_id] = seq
            elif chained is None or seq not in chained.assumed:
                self.scheduler.trim(seq)
        stats.emitted += emitted
        if f.dense:   # wall time from the proposals (or the last read-back) to the tokens appended, less compiling
            now = time.perf_counter()   # (its own proposals': a successor chained behind it has proposed since)
            since = max(f.drafted, self._verify_read)
            self.speculator.measured("verify", f.rows, emitted, now - since - compiled)
            self._verify_read = now
        key = "decode" if f.dense else "prefill"   # a ragged step counts as a mixed step does: its rows
        self.stats[f"{key}_tokens"] += emitted if f.dense else sum(n for _, n in f.chunks)
        self.stats[f"{key}_seconds"] += seconds
        self.phase_seconds["append"] += time.perf_counter() - t1
        return deltas

    def _chain_verify(self, f: VerifyInFlight) -> VerifyInFlight | None:
        """Launch the verify step after `f` (in flight) as if f accepts every draft and the token after them is
        the proposer's guess; None where chaining does not apply (see the module's docstring)."""
        s, spec = self.scheduler, self.speculator
        seqs = [seq for seq, _ in f.chunks]
        if not (self.config.tuning.chain_verify and f.dense and not f.dropped) or s.waiting and s.free_rows \
                or len(s.running) != len(seqs) or not getattr(spec.proposer, "host_only", False):
            return None
        if any(seq.finish_reason is not None or seq.grammar is not None or seq.params.has_penalties
               for seq in seqs):
            return None
        if np.mean([spec.chain_rate(seq) for seq in seqs]) < CHAIN_MIN_CHANCE:
            return None
        k = max(len(d) for d in f.ds)
        assumed, drafts = {}, {}
        for seq, d in zip(seqs, f.ds):
            x = list(d)
            proposal = spec.proposer.propose([_View(seq, x)], k + 1)[0]
            left = seq.max_new - len(seq.output_ids) - len(x) - 1   # what the chained row may still emit
            if len(proposal) < 2 or left < 1:
                return None
            assumed[seq], drafts[seq] = x + proposal[:1], proposal[1:1 + min(k, left - 1)]
            if not drafts[seq]:
                return None
        for seq in seqs:   # pages for the chained rows' K/V
            if not s.hold(seq, len(seq.prompt_ids) + len(seq.output_ids) + len(assumed[seq]) + len(drafts[seq])):
                return None
        self._drafting_started = time.perf_counter()
        return self._launch_verify(f.chunks, drafts, dense=True, assumed=assumed)

    def _step_verify_ahead(self) -> list[StreamDelta]:
        """The verify step in flight: chain its successor (if it applies), then read it back; the successor's rows
        whose assumption failed are marked dropped."""
        f = self._inflight_verify
        nxt = self._chain_verify(f)
        deltas = self._collect_verify(f, nxt)
        if nxt is not None:
            for seq, x in nxt.assumed.items():
                if seq.finish_reason is not None or len(seq.prompt_ids) + len(seq.output_ids) != \
                        nxt.base[seq] + len(x) or seq.output_ids[len(seq.output_ids) - len(x):] != x:
                    nxt.dropped.add(seq)
                self.speculator.record_chain(seq, seq not in nxt.dropped)
            self.speculator.stats.chained_steps += 1
            self.speculator.stats.chained_rows_dropped += len(nxt.dropped)
        else:   # unchained: whether it accepted everything is the evidence that chaining would have held
            for seq, full in f.full.items():
                self.speculator.record_chain(seq, full)
        self._inflight_verify = nxt
        if nxt is None:
            self._settle([seq for seq, _ in f.chunks])
        return deltas

    def _verify_sampling(self, seqs: list[Sequence], rows: int) -> SamplingArrays:
        """The sampling arrays of a verify step over these sequences: the last step's again where its sequences
        were the same (they are, step after step, while the batch stays)."""
        key = (rows, tuple(seq.request_id for seq in seqs))
        last = getattr(self, "_last_verify_sampling", None)
        if last is None or last[0] != key:
            last = self._last_verify_sampling = key, SamplingArrays.from_params(
                [seq.params for seq in seqs], [seq.seed for seq in seqs], rows)
        return last[1]


def _tokens_at(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.tokens[start:start + n], without joining the prompt and the output (a copy of both) as seq.tokens does."""
    p = seq.prompt_ids
    if start >= len(p):
        return seq.output_ids[start - len(p):start - len(p) + n]
    return p[start:start + n] + seq.output_ids[:max(start + n - len(p), 0)]
