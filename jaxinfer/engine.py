"""LLM (offline API) and Engine (the schedule -> step -> update loop).

The engine keeps every running sequence's tokens, pages and sampler row on the host, builds one
padded step at a time, and hands the compiled step to the ModelRunner:
- while any sequence still has prompt tokens to process, a *mixed* step carries prompt chunks
  (under a token budget) together with one decode token for each sequence already generating;
- otherwise a *decode* dispatch runs several decode steps on the device at once.
A sequence is admitted only when a sampler row and the pages for its whole length are free.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Sequence as Seq

import jax
import numpy as np

from jaxinfer.batch import StepBatch
from jaxinfer.config import ModelConfig, load_config
from jaxinfer.errors import JaxinferError, PromptTooLongError
from jaxinfer.kv_cache import bytes_per_page, slots_for
from jaxinfer.ops import get_ops
from jaxinfer.paging import PageAllocator
from jaxinfer.runner import DecodeBatch, ModelRunner
from jaxinfer.sampling import SamplingArrays, SamplingParams
from jaxinfer.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from jaxinfer.weights import load_params

MAX_STOP_IDS = 8


@dataclasses.dataclass
class EngineConfig:
    dtype: str = "float32"
    ops: str = "reference"
    max_model_len: int | None = None          # default: the model's max_position_embeddings
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512         # token budget of a mixed step (prompt chunk size)
    page_size: int = 16
    num_pages: int | None = None              # default: enough for max_num_seqs full-length sequences
    decode_steps: int = 8                     # decode steps per dispatch
    token_buckets: list[int] | None = None    # mixed-step sizes to compile (default: powers of two up to the budget)
    unroll_layers: bool = False               # unroll the layer loop of decode steps (no device while loop)
    seed: int = 0                             # seeds requests that bring none
    skip_tokenizer_init: bool = False         # token ids in and out only (no tokenizer.json needed)
    progress: bool = True
    compilation_cache: str | None = os.path.expanduser("~/.cache/jaxinfer/jax")

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None     # "stop" | "length" | None while running
    finished: bool


@dataclasses.dataclass
class StreamDelta:
    """What one engine step added to one request."""

    request_id: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclasses.dataclass
class _Sequence:
    request_id: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new: int
    stop_ids: list[int]
    detok: IncrementalDetokenizer | None
    stopper: StopStringMatcher
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    pages: list[int] = dataclasses.field(default_factory=list)
    row: int = -1
    num_computed: int = 0          # tokens whose K/V are in the cache
    finish_reason: str | None = None
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, self.text, list(self.output_ids),
                             list(self.logprobs), self.finish_reason, self.finish_reason is not None)


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, **overrides):
        self.config = config = dataclasses.replace(config or EngineConfig(), **overrides)
        config.validate()
        if config.compilation_cache:
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        t0 = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.cfg: ModelConfig = load_config(model_dir, config.dtype)
        self.tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_dir(model_dir)
        self.max_model_len = min(config.max_model_len or self.cfg.max_position_embeddings,
                                 self.cfg.max_position_embeddings)
        pages_per_seq = -(-self.max_model_len // config.page_size)
        num_pages = config.num_pages or config.max_num_seqs * pages_per_seq + 1
        if num_pages - 1 < pages_per_seq:
            raise ValueError(f"num_pages={num_pages} cannot hold one sequence of max_model_len={self.max_model_len}")
        params = load_params(model_dir, self.cfg, progress=config.progress)
        self.runner = ModelRunner(self.cfg, params, get_ops(config.ops), num_pages=num_pages,
                                  page_size=config.page_size, max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  steps_per_decode=config.decode_steps, token_buckets=config.token_buckets,
                                  unroll_layers=config.unroll_layers)
        self.pages = PageAllocator(num_pages)
        self.kv_bytes = num_pages * bytes_per_page(self.cfg, config.page_size)
        self.load_seconds = time.perf_counter() - t0
        self.compile_seconds = self.runner.warmup(progress=config.progress)
        self._free_rows = list(range(config.max_num_seqs))
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._finished: dict[int, _Sequence] = {}
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.stats = {"prefill_tokens": 0, "prefill_seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0}

    # ---- requests ----
    def encode(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine was started without a tokenizer: give prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if any(t < 0 or t >= self.cfg.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.cfg.vocab_size})")
        return None, ids

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        text, ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens; the context window is {self.max_model_len} "
                                     "and at least one token must be generated")
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            eos = (self.tokenizer.eos_token_ids if self.tokenizer else ()) + self.cfg.eos_token_ids
            stop_ids += [t for t in dict.fromkeys(eos) if t not in stop_ids]
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_IDS - len(self.cfg.eos_token_ids)} are supported")
        seq = _Sequence(
            request_id=next(self._ids), prompt=text, prompt_ids=ids, params=params,
            seed=params.seed if params.seed is not None else self._rng.getrandbits(32),
            max_new=min(params.max_tokens, self.max_model_len - len(ids)), stop_ids=stop_ids,
            detok=IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None,
            stopper=StopStringMatcher(params.stop or []),
        )
        self._waiting.append(seq)
        return seq.request_id

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- scheduling ----
    def _admit(self) -> None:
        while self._waiting and self._free_rows:
            seq = self._waiting[0]
            need = -(-(len(seq.prompt_ids) + seq.max_new) // self.config.page_size)
            if need > self.pages.num_free:
                break
            self._waiting.popleft()
            seq.pages = self.pages.allocate(need)
            seq.row = self._free_rows.pop()
            self._running.append(seq)

    def step(self) -> list[StreamDelta]:
        """Run one dispatch (a mixed step or a multi-step decode) and return what it produced."""
        self._admit()
        if not self._running:
            return []
        if any(s.prefilling for s in self._running):
            return self._mixed_step()
        return self._decode_step()

    def _mixed_step(self) -> list[StreamDelta]:
        r = self.runner
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[_Sequence, int]] = []          # (sequence, tokens this step)
        for seq in self._running:                         # decodes first: one token each
            if not seq.prefilling:
                chosen.append((seq, 1))
        budget -= len(chosen)
        for seq in self._running:
            if seq.prefilling and budget > 0:
                n = min(len(seq.prompt_ids) - seq.num_computed, budget)
                chosen.append((seq, n))
                budget -= n
        total = sum(n for _, n in chosen)
        a = r.empty_mixed(r.token_bucket(total))
        t = 0
        for b, (seq, n) in enumerate(chosen):
            start = seq.num_computed
            a["tokens"][t:t + n] = seq.tokens[start:start + n]
            a["positions"][t:t + n] = np.arange(start, start + n)
            a["slot_mapping"][t:t + n] = slots_for(seq.pages, start, start + n, self.config.page_size)
            a["token_seq"][t:t + n] = b
            a["page_table"][b, :len(seq.pages)] = seq.pages
            a["prompt_lens"][b] = len(seq.prompt_ids)
            a["sample_index"][b] = t + n - 1
            a["emits"][b] = start + n >= len(seq.tokens)
            a["first_chunk"][b] = start == 0
            a["state_row"][b] = seq.row
            a["step_index"][b] = len(seq.output_ids)
            t += n
            a["query_start"][b + 1:] = t
        sampling = SamplingArrays.from_params([s.params for s, _ in chosen], [s.seed for s, _ in chosen],
                                              r.max_num_seqs)
        t0 = time.perf_counter()
        tokens, logprobs = r.run_mixed(jax.device_put(StepBatch(**a, sampling=sampling)))
        elapsed = time.perf_counter() - t0
        self.stats["prefill_tokens"] += total
        self.stats["prefill_seconds"] += elapsed
        deltas = []
        for b, (seq, n) in enumerate(chosen):
            seq.num_computed += n
            if a["emits"][b]:
                deltas.append(self._append(seq, [int(tokens[b])], [float(logprobs[b])]))
        return self._retire(deltas)

    def _decode_step(self) -> list[StreamDelta]:
        r = self.runner
        seqs = self._running
        B = r.batch_bucket(len(seqs))
        a = r.empty_decode(B, MAX_STOP_IDS)
        for b, seq in enumerate(seqs):
            a["tokens"][b] = seq.tokens[-1]
            a["positions"][b] = len(seq.tokens) - 1
            a["page_table"][b, :len(seq.pages)] = seq.pages
            a["state_row"][b] = seq.row
            a["step_index"][b] = len(seq.output_ids)
            a["remaining"][b] = seq.max_new - len(seq.output_ids)
            a["stop_ids"][b, :len(seq.stop_ids)] = seq.stop_ids
            a["active"][b] = True
        sampling = SamplingArrays.from_params([s.params for s in seqs], [s.seed for s in seqs], B)
        t0 = time.perf_counter()
        tokens, logprobs, emitted = r.run_decode(jax.device_put(DecodeBatch(**a, sampling=sampling)))
        self.stats["decode_seconds"] += time.perf_counter() - t0
        self.stats["decode_tokens"] += int(emitted.sum())
        deltas = []
        for b, seq in enumerate(seqs):
            rows = np.nonzero(emitted[:, b])[0]
            seq.num_computed += len(rows)
            deltas.append(self._append(seq, tokens[rows, b].tolist(), logprobs[rows, b].tolist()))
        return self._retire(deltas)

    # ---- results ----
    def _append(self, seq: _Sequence, new_ids: list[int], new_logprobs: list[float]) -> StreamDelta:
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        text, accepted = "", []
        for tok, lp in zip(new_ids, new_logprobs):
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            accepted.append(tok)
            if tok in seq.stop_ids:
                seq.finish_reason = "stop"
            elif seq.detok is not None:
                emitted, hit = seq.stopper.feed(seq.detok.add([tok]))
                text += emitted
                if hit:
                    seq.finish_reason = "stop"
            if seq.finish_reason is None and len(seq.output_ids) >= seq.max_new:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                break
        if seq.finish_reason is not None and seq.detok is not None and not seq.stopper.stopped:
            emitted, _ = seq.stopper.feed(seq.detok.flush())   # a character left unfinished at the end
            text += emitted + seq.stopper.flush()
        seq.text += text
        return StreamDelta(seq.request_id, text, accepted, seq.finish_reason is not None, seq.finish_reason)

    def _retire(self, deltas: list[StreamDelta]) -> list[StreamDelta]:
        for seq in [s for s in self._running if s.finish_reason is not None]:
            self._running.remove(seq)
            self.pages.release(seq.pages)
            self._free_rows.append(seq.row)
            self._finished[seq.request_id] = seq
        return deltas

    def take_finished(self, request_id: int) -> RequestOutput:
        return self._finished.pop(request_id).output()

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is and free its pages at once."""
        for seq in list(self._waiting):
            if seq.request_id == request_id:
                self._waiting.remove(seq)
        for seq in list(self._running):
            if seq.request_id == request_id:
                seq.finish_reason = "abort"
        self._retire([])
        self._finished.pop(request_id, None)


class LLM:
    """Offline generation: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model_dir: str | Path, **engine_options):
        self.engine = Engine(model_dir, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp or SamplingParams()))
        except (JaxinferError, ValueError):
            for i in ids:
                self.engine.abort(i)
            raise
        while self.engine.has_unfinished():
            self.engine.step()
        return [self.engine.take_finished(i) for i in ids]


def stream(engine: Engine, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterable[StreamDelta]:
    """Generate one request alone, yielding its text as it is produced."""
    rid = engine.add_request(prompt, params)
    while True:
        for delta in engine.step():
            if delta.request_id == rid:
                yield delta
                if delta.finished:
                    engine.take_finished(rid)
                    return
