"""The engine's verify steps (speculative decoding), as methods of Engine: which drafts a planned step verifies
(`_drafts`), the step itself (`_verify`: built, run, its accepted tokens appended and its rejected drafts rolled
back), and the captured layer states handed to a DFlash proposer (`_observe`). Engine (engine.py) calls them from
`step` when its Speculator (speculation.py) has drafts."""

from __future__ import annotations

import time

import numpy as np

from jaxinfer.engine.outputs import StreamDelta
from jaxinfer.engine.scheduler import Sequence
from jaxinfer.model.kv_cache import SCRATCH_PAGE
from jaxinfer.runner.batch import StepBatch, VerifyBatch
from jaxinfer.runner.transfer import to_device_packed
from jaxinfer.runner.variants import StepVariant, choose_sampler
from jaxinfer.sampling.sample import SamplingArrays

RAGGED_DRAFTS_MAX_BATCH = 4   # the most generating sequences whose drafts ride beside prompt chunks


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
        read-back (overlap_mixed) while prompt work follows this step: a verify step would break that chain."""
        if len(generating) > RAGGED_DRAFTS_MAX_BATCH:
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
        r, ps = self.runner, self.config.page_size
        t_build = time.perf_counter()
        seqs = [seq for seq, _ in chunks]
        B = len(seqs)
        ds = [drafts.get(seq, ()) for seq in seqs]
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
            d, start, pages = ds[b], seq.num_computed, seq.pages
            m = n + len(d)
            span = width if dense else m   # rows it takes (dense: width, those past its drafts padding)
            tokens += _tokens_at(seq, start, n)
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
        s["step_index"][:B] = [len(seq.output_ids) for seq in seqs]
        s["query_start"][1:B + 1] = ends
        s["query_start"][B + 1:] = used
        a["num_drafts"][:B] = [len(d) for d in ds]
        params = [seq.params for seq in seqs]
        batch = to_device_packed(VerifyBatch(step=StepBatch(**s, sampling=self._verify_sampling(seqs, rows)), **{
            k: a[k] for k in ("score_rows", "drafts", "num_drafts")}))
        greedy = choose_sampler(params, rows, plain_sampling=False) == "greedy"   # verify steps sample by sorting
        variant = StepVariant("verify", "greedy" if greedy else "sort", "verify" if dense else "paged", width)
        tops = any(q.logprobs is not None for q in params)   # top logprobs read back only where asked for
        t0 = time.perf_counter()
        compiling = r.first_call_seconds
        outs = r.launch_verify(batch, variant)
        self._observe(s)
        accepted, tokens, logprobs, top_v, top_i = r.fetch(outs) if tops else r.fetch(outs[:3]) + (None, None)
        t1 = time.perf_counter()
        seconds = t1 - t0 - (r.first_call_seconds - compiling)   # a step compiled on first use: not its time
        self.phase_seconds["build"] += t0 - t_build
        self.phase_seconds["run"] += t1 - t0
        stats = self.speculator.stats
        stats.verify_steps += 1
        deltas, emitted = [], 0
        for b, ((seq, n), emits_b, acc) in enumerate(zip(chunks, emits, accepted[:B].tolist())):
            if not emits_b:
                seq.num_computed += n
                continue
            if ds[b]:
                self.speculator.record(seq, len(ds[b]), acc)
            seq.num_computed += n + acc
            deltas.append(self._append(seq, tokens[b, :acc + 1], logprobs[b, :acc + 1],
                                       None if top_v is None else top_v[b, :acc + 1],
                                       None if top_i is None else top_i[b, :acc + 1]))
            emitted += acc + 1
            # a stop among the accepted drafts
            seq.num_computed = min(seq.num_computed, len(seq.prompt_ids) + len(seq.output_ids))
            if seq.finish_reason is not None:
                self._finished[seq.request_id] = seq
            else:
                self.scheduler.trim(seq)
        stats.emitted += emitted
        if dense:   # wall time from the proposals to the tokens appended (host work included), less compiling
            self.speculator.measured("verify", rows, emitted, time.perf_counter() - self._drafting_started -
                                     (r.first_call_seconds - compiling))
        key = "decode" if dense else "prefill"   # a ragged step counts as a mixed step does: its rows
        self.stats[f"{key}_tokens"] += emitted if dense else sum(n for _, n in chunks)
        self.stats[f"{key}_seconds"] += seconds
        self.phase_seconds["append"] += time.perf_counter() - t1
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
