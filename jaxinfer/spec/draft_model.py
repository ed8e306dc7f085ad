"""Draft-model proposals: a smaller model of the same tokenizer drafts k tokens greedily, one after another.

The draft model has its own ModelRunner: its weights, its own KV pool with as many pages as the target's, and
its compiled steps. Its pool is indexed by the target's page tables (the same page ids, in a second array), so
the scheduler's pages serve both and nothing else is allocated. Its K/V are filled lazily: a proposal first
runs the tokens the draft has not seen (the whole prompt the first time; afterwards the target's last token and
any accepted drafts beyond what it computed) in ragged prompt steps, which sample its first draft, then a decode
dispatch of k - 1 greedy steps. Drafts are greedy, so the rejection test treats them as one-hot proposals
(lossless all the same: sampling.rejection). Rejected drafts' K/V are simply overwritten later: what the draft
holds is tracked per sequence by comparing its last drafts with the tokens the sequence then committed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import ModelConfig, load_config
from jaxinfer.model.kv_cache import bytes_per_page, kv_cache_dtype, slots_for
from jaxinfer.model.rotary import takes_long_factors
from jaxinfer.model.weights import load_params
from jaxinfer.runner.batch import DecodeBatch, StepBatch
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.runner.transfer import to_device, to_device_packed
from jaxinfer.runner.variants import StepVariant
from jaxinfer.sampling.sample import SamplingArrays
from jaxinfer.settings import EngineConfig
from jaxinfer.spec.proposer import DraftedSequence
from jaxinfer.text import Tokenizer


@dataclasses.dataclass
class _DraftState:
    """What the draft model holds for one sequence."""

    computed: int = 0                  # leading tokens whose K/V are in the draft's pool
    drafted_from: int = 0              # the sequence's length when it last drafted
    drafts: list[int] = dataclasses.field(default_factory=list)   # those drafts (the K/V of all but the last kept)
    preemptions: int = 0               # the sequence's count then (a preemption moves its pages)


class DraftModelProposer:
    name = "draft"

    def __init__(self, path: str, target_cfg: ModelConfig, tokenizer: Tokenizer | None, config: EngineConfig):
        """Read the draft model and check it against the target (same vocabulary and tokenizer); its runner is
        made by `attach`, once the target's pool size is known."""
        if not path:
            raise ValueError("speculative draft:DIR needs the draft model's folder")
        self.path = Path(path)
        self.cfg = load_config(self.path, target_cfg.dtype)
        if self.cfg.vocab_size != target_cfg.vocab_size:
            raise ModelLoadError(f"the draft model {self.path} has a vocabulary of {self.cfg.vocab_size} tokens, the "
                                 f"target {target_cfg.vocab_size}: a draft model must share the target's tokenizer")
        if tokenizer is not None:
            _check_same_tokenizer(self.path, tokenizer)
        self.config = dataclasses.replace(config, speculative=None, num_speculative_tokens=None,
                                          decode_steps=max(1, config.num_speculative_tokens - 1),
                                          enable_prompt_logprobs=False, quantization=None)
        self.params = load_params(self.path, self.cfg, progress=False, per_layer=config.tuning.unroll_layers)
        self.kv_dtype = kv_cache_dtype(self.cfg, config.kv_cache_dtype)
        self.runner: ModelRunner | None = None
        self._state: dict[int, _DraftState] = {}

    def page_bytes(self, page_size: int) -> int:
        """Device bytes of one page of the draft's pool (the engine sizes the target's pool net of them)."""
        return bytes_per_page(self.cfg, page_size, self.kv_dtype)

    def attach(self, num_pages: int, max_model_len: int, ops: ModuleType,
               target_runner: ModelRunner | None = None) -> None:
        self.runner = ModelRunner(self.cfg, self.params, ops, self.config, num_pages=num_pages,
                                  max_model_len=max_model_len, kv_dtype=self.kv_dtype)
        self.runner.warmup(progress=False, compile=False)
        del self.params   # the runner holds them

    def forget(self, seq: DraftedSequence) -> None:
        self._state.pop(seq.request_id, None)

    def propose(self, seqs: Sequence[DraftedSequence], k: int) -> list[list[int]]:
        """k greedy drafts for each sequence (each one's tokens so far, `seq.tokens`, its pages `seq.pages`)."""
        r = self.runner
        starts = [self._computed(seq) for seq in seqs]
        first = self._catch_up(seqs, starts)
        if k == 1:
            drafts = [[t] for t in first]
        else:
            B = r.batch_bucket(len(seqs))
            a = r.empty_decode(B)
            for b, seq in enumerate(seqs):
                a["tokens"][b] = first[b]
                a["positions"][b] = len(seq.tokens)
                a["page_table"][b, :len(seq.pages)] = seq.pages
                a["state_row"][b] = seq.row
                a["remaining"][b] = k - 1
                a["active"][b] = True
            variant = StepVariant("decode", "greedy", steps=r.decode_steps_for(B))
            batch = to_device(DecodeBatch(**a, sampling=SamplingArrays.from_params([], [], B)))
            tokens = r.run_decode(batch, variant)[0]                    # [steps, B]
            drafts = [[first[b]] + tokens[:k - 1, b].tolist() for b in range(len(seqs))]
        for seq, d in zip(seqs, drafts):
            st = self._state[seq.request_id]
            st.computed, st.drafted_from, st.drafts = len(seq.tokens), len(seq.tokens), d
        return drafts

    def _computed(self, seq) -> int:
        """The sequence's leading tokens whose K/V the draft's pool holds: what it computed, and its drafts that
        the sequence then took (all but the last, whose K/V it never wrote)."""
        st = self._state.setdefault(seq.request_id, _DraftState(preemptions=seq.preemptions))
        if st.preemptions != seq.preemptions:   # its pages were given up and it was recomputed elsewhere
            self._state[seq.request_id] = st = _DraftState(preemptions=seq.preemptions)
        taken = 0
        committed = seq.tokens[st.drafted_from:]
        for d, t in zip(st.drafts[:-1], committed):
            if d != t:
                break
            taken += 1
        return min(st.computed + taken, len(seq.tokens) - 1)

    def _catch_up(self, seqs, starts: list[int]) -> list[int]:
        """Run each sequence's tokens from its start to its end through the draft in ragged prompt steps (the
        token budget a step); return the greedy token after each sequence's last."""
        r, ps = self.runner, self.runner.page_size
        budget = r.token_buckets[-1]
        pending = [(b, s) for b, s in enumerate(starts)]
        first = [0] * len(seqs)
        variant = StepVariant("mixed", "greedy" if StepVariant("mixed", "greedy") in r.steps else "branch")
        while pending:
            chunks, used, rest = [], 0, []
            for b, start in pending:
                n = min(len(seqs[b].tokens) - start, budget - used)
                if n <= 0 or len(chunks) == r.max_num_seqs:
                    rest.append((b, start))
                    continue
                chunks.append((b, start, n))
                used += n
                if start + n < len(seqs[b].tokens):
                    rest.append((b, start + n))
            a = r.empty_mixed(r.token_bucket(used))
            t = 0
            for i, (b, start, n) in enumerate(chunks):
                seq = seqs[b]
                a["tokens"][t:t + n] = seq.tokens[start:start + n]
                a["positions"][t:t + n] = np.arange(start, start + n)
                a["slot_mapping"][t:t + n] = slots_for(seq.pages, start, start + n, ps)
                a["token_seq"][t:t + n] = i
                a["page_table"][i, :len(seq.pages)] = seq.pages
                a["sample_index"][i] = t + n - 1
                a["emits"][i] = start + n == len(seq.tokens)
                a["state_row"][i] = seq.row
                if "rope_long" in a:   # a LongRoPE draft: a long prompt's tokens all take the long factors
                    a["rope_long"][i] = takes_long_factors(self.cfg, len(seq.prompt_ids))
                t += n
                a["query_start"][i + 1:] = t
            sampling = SamplingArrays.from_params([], [], r.max_num_seqs)
            tokens = r.run_mixed(to_device_packed(StepBatch(**a, sampling=sampling)), variant)[0]
            for i, (b, start, n) in enumerate(chunks):
                if start + n == len(seqs[b].tokens):
                    first[b] = int(tokens[i])
            pending = rest
        return first


def _check_same_tokenizer(path: Path, tokenizer: Tokenizer) -> None:
    """The draft's tokenizer.json must map tokens to the same ids as the target's."""
    try:
        draft = Tokenizer.from_dir(path)
    except Exception as e:
        raise ModelLoadError(f"the draft model {path} has no readable tokenizer ({e}); a draft model must share "
                             "the target's tokenizer") from e
    if draft.backend.get_vocab(with_added_tokens=True) != tokenizer.backend.get_vocab(with_added_tokens=True):
        raise ModelLoadError(f"the draft model {path} has a different tokenizer from the target's: a draft model "
                             "must share the target's tokenizer")
