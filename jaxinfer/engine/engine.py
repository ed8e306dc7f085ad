"""Engine: the schedule -> step -> update loop.

The scheduler (scheduler.py) decides what the next step computes; the engine turns that
plan into padded step arrays, runs the compiled step on the ModelRunner, and turns sampled tokens
into text (incremental detokenization, stop tokens and strings, finish reasons):
- a *mixed* step carries prompt chunks (under a token budget) together with one decode token for
  each sequence already generating;
- a *decode* dispatch runs several decode steps on the device at once (one, as a forward pass and then a
  sampling under the host's masks, while a structured-output request runs: constraints.py);
- with speculative decoding, a *verify* step scores each generating sequence's drafted tokens in one pass
  (beside prompt chunks, or alone in place of a decode dispatch) and keeps those the target accepts.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import random
import sys
import time
import weakref
from pathlib import Path
from typing import Sequence as Seq

import jax
import numpy as np

from jaxinfer.engine.constraints import Constraints, advance
from jaxinfer.engine.dispatch_timing import DispatchTiming
from jaxinfer.engine.generation_defaults import describe, read_generation_defaults
from jaxinfer.engine.outputs import RequestOutput, StreamDelta, output_of
from jaxinfer.engine.paging import PageAllocator
from jaxinfer.engine.scheduler import Scheduler, Sequence
from jaxinfer.engine.speculation import Speculator, make_proposer, resolve_speculative
from jaxinfer.engine.verify_steps import VerifySteps
from jaxinfer.errors import PromptTooLongError
from jaxinfer.model.config import ModelConfig, load_config
from jaxinfer.model.kv_cache import bytes_per_page, kv_cache_dtype, slots_for
from jaxinfer.model.quantize import describe as describe_weights
from jaxinfer.model.rotary import takes_long_factors
from jaxinfer.model.tensor_parallel import device_page_bytes
from jaxinfer.model.weights import load_params
from jaxinfer.ops import get_ops
from jaxinfer.ops.tensor_parallel import tensor_parallel_ops
from jaxinfer.runner.batch import DecodeBatch, StepBatch
from jaxinfer.runner.distributed import initialize as initialize_distributed
from jaxinfer.runner.distributed import least_of_all_processes, shared_seed
from jaxinfer.runner.executable_cache import ExecutableCache
from jaxinfer.runner.mesh import make_mesh, tensor_parallel_config
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.runner.transfer import to_device, to_device_packed
from jaxinfer.runner.variants import StepVariant, choose_sampler
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.sample import SamplingArrays
from jaxinfer.settings import EngineConfig
from jaxinfer.text import IncrementalDetokenizer, StopStringMatcher, Tokenizer

MAX_STOP_IDS = 8
# Engine.phase_seconds: schedule (the scheduler's plan), build (a mixed step's arrays and their copy to
# the device), run (a mixed step's call and read-back: mostly waiting on the device), append (its tokens
# into text, stop checks), settle (prefix-cache blocks, releasing finished sequences), chain (building
# and launching a decode dispatch), collect (reading a decode dispatch back and appending its tokens).
STEP_PHASES = ("schedule", "build", "run", "append", "settle", "chain", "collect")


@dataclasses.dataclass
class PendingSample:
    """A constrained decode step chained behind the one being read back: its forward pass launched, its sampling
    waiting for the masks that the read-back tokens give (Engine._sample_masked)."""

    logits: jax.Array


@dataclasses.dataclass
class MixedInFlight:
    """A mixed step launched and not yet read back."""

    chunks: list[tuple[Sequence, int]]
    emits: list[bool]          # per chunk: this step samples the sequence's next token
    scored: list               # prompt-logprob rows (Engine._prompt_rows)
    outs: tuple                # device arrays: tokens, logprobs, top values, top ids (, prompt logprobs)
    launched: float            # perf_counter before the launch
    tokens: int                # prompt and decode tokens computed


class Engine(VerifySteps):
    """The schedule -> step -> update loop over one model. `Engine(model_dir, **settings)`: any EngineConfig
    or Tuning field (jaxinfer/settings.py) by name; an unknown name is an error."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, **settings):
        spec = settings.get("distributed", config.distributed if config else None)
        if spec:
            initialize_distributed(spec)   # before anything starts JAX's backends
        backend = jax.default_backend()
        config = tensor_parallel_config(EngineConfig.from_options(config, **settings)).resolved(backend,
                                                                                               sys.stderr.isatty())
        config.validate()
        config = resolve_speculative(config)
        if jax.process_count() > 1 and config.seed is None:   # every host draws the same request seeds
            config = dataclasses.replace(config, seed=shared_seed())
        self.config = config
        t = config.tuning
        # JAX's own cache as well (keyed by the lowered module), except where XLA:CPU executables are also saved
        # whole: one loaded from JAX's cache and saved again can lack its kernels ("Function ... not found")
        if config.cache_dir and not (backend == "cpu" and t.executable_cache):
            jax.config.update("jax_compilation_cache_dir", os.path.join(config.cache_dir, "jax"))
            # small programs too: a warm start compiles nothing
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        t0 = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.cfg: ModelConfig = load_config(model_dir, config.dtype)
        self.ops_name = config.ops if config.ops != "auto" else "pallas" if backend == "gpu" else "reference"
        ops = get_ops(self.ops_name)
        self.mesh = make_mesh(config.tensor_parallel_size, self.cfg)   # None: one device
        if self.mesh is not None:
            ops = tensor_parallel_ops(ops, self.mesh)
        self.tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_dir(model_dir)
        self.sampling_defaults = read_generation_defaults(config.generation_config, model_dir)
        self.max_model_len = min(config.max_model_len or self.cfg.max_position_embeddings,
                                 self.cfg.max_position_embeddings)
        params = load_params(model_dir, self.cfg, progress=config.progress, per_layer=t.unroll_layers,
                             quantization=config.quantization, mesh=self.mesh)
        self.weights_summary = describe_weights(params, self.cfg.tie_embeddings)   # dtype and bytes held
        self.kv_dtype = kv_cache_dtype(self.cfg, config.kv_cache_dtype)
        proposer = make_proposer(config, self) if config.speculative else None   # a draft model loads here
        self._draft_page_bytes = proposer.page_bytes(config.page_size) if hasattr(proposer, "page_bytes") else 0
        num_pages = least_of_all_processes(self._num_pages())   # several hosts: one pool size, one schedule
        exe_cache = ExecutableCache(os.path.join(config.cache_dir, "executables")) \
            if config.cache_dir and t.executable_cache else None
        self.runner = ModelRunner(self.cfg, params, ops, config, num_pages=num_pages, max_model_len=self.max_model_len,
                                  kv_dtype=self.kv_dtype, executable_cache=exe_cache,
                                  capture_layers=getattr(proposer, "capture_layers", ()))
        self.pages = PageAllocator(num_pages)
        if hasattr(proposer, "attach"):   # its own pool, indexed by the target's page tables
            proposer.attach(num_pages, self.max_model_len, ops, self.runner)
        self.speculator = Speculator(proposer, config.num_speculative_tokens) if proposer else None
        self.kv_bytes = num_pages * bytes_per_page(self.cfg, config.page_size, self.kv_dtype)
        self.load_seconds = time.perf_counter() - t0
        self.compile_seconds = self.runner.warmup(progress=config.progress, threads=t.compile_threads,
                                                  compile=config.compile_all_at_start)
        self.summary = self._summary(backend, num_pages)
        eos = (self.tokenizer.eos_token_ids if self.tokenizer else ()) + self.cfg.eos_token_ids
        self.constraints = Constraints(self.tokenizer, self.cfg.vocab_size, list(dict.fromkeys(eos)))
        self.scheduler = Scheduler(self.pages, config.page_size, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.decode_steps, on_start=_weakly(self._on_start),
                                   prefix_caching=config.enable_prefix_caching,
                                   token_buckets=self.runner.token_buckets,
                                   # (a drafter with a pool of its own reads every position through the tables)
                                   window=0 if hasattr(proposer, "attach") else self.cfg.kv_window,
                                   rope_original_length=self.cfg.rope_longrope[2] if self.cfg.rope_longrope else 0)
        self._finished: dict[int, Sequence] = {}
        self._inflight: tuple | None = None      # a decode dispatch not yet read back
        self._inflight_mixed: MixedInFlight | None = None   # a mixed step not yet read back (overlap_mixed)
        self._inflight_verify = None             # a dense verify step not yet read back (Tuning.chain_verify)
        self._mixed_read = 0.0                   # when the last mixed step was read back
        self._decode_started = 0.0
        self._drafting_started = 0.0
        self._verify_read = 0.0                  # when the last dense verify step was read back
        self._timing = DispatchTiming()
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        # Mixed steps read back since the server last took them: (token bucket, seconds from the later of
        # its launch and the previous read-back to its own read-back: its share of the engine thread,
        # overlapped or not), for the server's step-time metrics.
        self.mixed_step_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=1024)
        self.stats = {"prefill_tokens": 0, "prefill_seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0}
        # Where step() spends its time, by phase (seconds, summed; see STEP_PHASES): what the host does
        # between two device steps, beside waiting for them.
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)

    def _num_pages(self) -> int:
        """Pages for the KV pool: as configured; else a fraction of the device memory left after the
        weights (on devices that report it), at most twice what max_num_seqs full-length sequences
        use (the rest keeps prefix-cached pages; more would only take the memory the steps' temporaries
        need); else enough for max_num_seqs full-length sequences."""
        c = self.config
        pages_per_seq = -(-self.max_model_len // c.page_size)
        num_pages = c.tuning.num_pages
        stats = jax.local_devices()[0].memory_stats() if num_pages is None else None
        if num_pages is None and stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] * c.gpu_memory_fraction - stats.get("bytes_in_use", 0)
            # Leave room for the activations of the largest step.
            free -= 4 * c.max_num_batched_tokens * (self.cfg.hidden_size * 8 + self.cfg.vocab_size)
            if c.speculative:   # a verify step's acceptance holds ~6 float32 [rows, k + 1, V] arrays (rejection.verify)
                free -= 6 * 4 * c.max_num_seqs * (c.num_speculative_tokens + 1) * self.cfg.vocab_size
            page_bytes = device_page_bytes(self.cfg, c.tensor_parallel_size, c.page_size, self.kv_dtype) + \
                self._draft_page_bytes
            num_pages = min(int(free // page_bytes),
                            2 * c.max_num_seqs * pages_per_seq + 1)
            if num_pages - 1 < pages_per_seq:
                raise ValueError(
                    f"the KV pool would get {max(num_pages, 0)} pages, too few for one sequence of "
                    f"max_model_len={self.max_model_len}: {stats.get('bytes_in_use', 0) / 2**30:.1f} GiB of the "
                    f"device's {stats['bytes_limit'] / 2**30:.1f} GiB are in use (another engine still alive in "
                    f"this process?); lower max_model_len or raise gpu_memory_fraction")
        num_pages = num_pages or c.max_num_seqs * pages_per_seq + 1
        if num_pages - 1 < pages_per_seq:
            raise ValueError(f"the KV pool ({num_pages} pages) cannot hold one sequence of "
                             f"max_model_len={self.max_model_len}")
        return num_pages

    def _summary(self, backend: str, num_pages: int) -> str:
        """The one-line start-up summary: what was picked, how long loading and compiling took."""
        c = self.config
        picked = lambda value, asked, why: f"{value} ({why})" if asked == "auto" else value
        compiled = (f"compiled {len(self.runner._executables)} steps in {self.compile_seconds:.1f} s"
                    if c.compile_all_at_start else "steps compile on first use")
        defaults = f"; sampling defaults {describe(self.sampling_defaults)}" if self.sampling_defaults else ""
        if c.speculative:
            defaults = f"; speculative {c.speculative}, up to {c.num_speculative_tokens} drafts a step" + defaults
        return (f"[jaxinfer: {self.model_dir.name}, {self.cfg.family}, "
                f"{picked(self.cfg.dtype, c.dtype, 'the checkpoint' + chr(39) + 's')}, "
                f"ops {picked(self.ops_name, c.ops, backend)}; {self.weights_summary}; "
                f"KV cache {(num_pages - 1) * c.page_size:,} tokens "
                f"({self.kv_bytes / 2**20:,.1f} MiB {jax.numpy.dtype(self.kv_dtype).name}{self._kv_capacity()}); "
                f"loaded in {self.load_seconds:.1f} s; {compiled}{defaults}]")

    def _kv_capacity(self) -> str:
        """For a cache narrower than the model's dtype (fp8, int8 with its scales): how many times the tokens a cache
        in the model's dtype holds in the same bytes (the pool sized from free memory gets that many more pages)."""
        c = self.config
        ratio = bytes_per_page(self.cfg, c.page_size, self.cfg.jnp_dtype) / bytes_per_page(self.cfg, c.page_size,
                                                                                             self.kv_dtype)
        return f", {ratio:.2f}x the tokens of a {jax.numpy.dtype(self.cfg.jnp_dtype).name} cache" if ratio > 1 else ""

    def _on_start(self, seq: Sequence) -> None:
        # The sampler row's prompt mask and output counts matter only to a request with a penalty: without
        # one, apply_penalties returns the logits unchanged whatever the row holds (left by the row's last
        # sequence). Skipping the reset saves a copy and a dispatch of host time per request.
        if seq.params.has_penalties:
            self.runner.start_sequence(seq.row, seq.prompt_ids, seq.output_ids)

    # ---- requests ----
    def encode(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine was started without a tokenizer: give prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        arr = np.asarray(prompt) if isinstance(prompt, (list, np.ndarray)) else None
        if arr is not None and arr.ndim == 1 and np.issubdtype(arr.dtype, np.integer):   # ~4x faster than by element
            ids = arr.tolist()
            bad = arr.size and (arr.min() < 0 or arr.max() >= self.cfg.vocab_size)
        else:
            ids = [int(t) for t in prompt]
            bad = ids and (min(ids) < 0 or max(ids) >= self.cfg.vocab_size)
        if bad:
            raise ValueError(f"prompt token ids must lie in [0, {self.cfg.vocab_size})")
        return None, ids

    def default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: the generation config's defaults (generation_config)."""
        return SamplingParams(**self.sampling_defaults)

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> int:
        params = params or self.default_sampling_params()
        if params.n != 1:
            raise ValueError(f"an engine request is one completion (n=1), got n={params.n}: LLM.generate runs n")
        text, ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.config.max_logprobs:
                raise ValueError(f"{name}: at most {self.config.max_logprobs} are served, got {k}")
        if params.prompt_logprobs is not None and not self.config.enable_prompt_logprobs:
            raise ValueError("prompt_logprobs: this engine was started without enable_prompt_logprobs")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"this model's maximum context length is {self.max_model_len} tokens; the "
                                     f"prompt has {len(ids)} tokens and leaves no room for a completion")
        if len(ids) + params.max_tokens > self.max_model_len:   # rejected, as the server does, not cut short
            raise PromptTooLongError(f"this model's maximum context length is {self.max_model_len} tokens; you "
                                     f"asked for {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                                     f"{params.max_tokens} in the completion)")
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            eos = (self.tokenizer.eos_token_ids if self.tokenizer else ()) + self.cfg.eos_token_ids
            stop_ids += [t for t in dict.fromkeys(eos) if t not in stop_ids]
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_IDS - len(self.cfg.eos_token_ids)} are supported")
        seq = Sequence(
            request_id=next(self._ids), prompt=text, prompt_ids=ids, params=params,
            seed=params.seed if params.seed is not None else self._rng.getrandbits(32),
            max_new=params.max_tokens, stop_ids=stop_ids,
            detok=IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None,
            stopper=StopStringMatcher(params.stop or []),
            grammar=self.constraints.matcher(params.structured) if params.structured else None,
        )
        self.scheduler.add(seq)
        return seq.request_id

    def wait(self) -> None:
        """Block until the decode dispatch in flight (if any) has finished on the device, without
        reading it back or launching its successor: a server that has taken a new request calls
        this, adds the request, then `step()`, so that the request waits for at most the one dispatch
        already running rather than also for the one chained behind it (see `chain_at`)."""
        if self._inflight is not None:
            self.runner.wait(self._inflight[2])
            self._timing.finished()

    def chain_at(self) -> float | None:
        """When (time.perf_counter) the host should start launching the in-flight decode dispatch's
        successor for the device not to idle: its expected end less the time a launch takes. None with
        no dispatch in flight or none of its batch size timed yet. A server waits for newcomers until
        then: a launch blocks the host for about a step, which a wait-then-launch loop would expose."""
        if self._inflight is None:
            return None
        return self._timing.chain_at(self.runner.batch_bucket(len(self._inflight[0])),
                                     early=self.config.tuning.chain_early_ms / 1e3)

    def inflight_done(self) -> bool:
        """Whether the decode dispatch in flight has finished on the device (no wait); its end is
        timed the first time this sees it."""
        if self._inflight is None or not self._inflight[2][0].is_ready():
            return False
        self._timing.finished()
        return True

    def has_unfinished(self) -> bool:
        return self._inflight is not None or self._inflight_mixed is not None or self._inflight_verify is not None \
            or self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pages.hit_rate

    # ---- steps ----
    def step(self) -> list[StreamDelta]:
        """Run one dispatch and return what has been read back.

        Decode dispatches are read back one dispatch late: while the batch stays the same (nobody
        waiting to join, pages to spare), the next dispatch starts on the device from the previous
        one's advanced state before the host reads and detokenizes the previous one's tokens, so
        the device does not wait on Python. Sequences that turn out to have finished are computed
        once more and their extra tokens dropped.
        """
        ph, t0 = self.phase_seconds, time.perf_counter()
        if self._inflight is not None:
            seqs, advanced, outs = self._inflight
            if self._newcomers_fit():   # their prompt step goes on the device behind this dispatch
                plan = self.scheduler.schedule_ahead(set(), busy=set(seqs))
                ph["schedule"] += time.perf_counter() - t0
                if plan is not None:
                    self._inflight_mixed = self._launch_mixed(plan.chunks)
                t0 = time.perf_counter()
            bucket = self.runner.batch_bucket(len(seqs))
            expected_end = self._timing.expected_end(bucket)
            self._inflight = self._chain(seqs, advanced)
            t1 = time.perf_counter()
            deltas = self._collect_decode(seqs, outs)
            if self._inflight is not None and isinstance(self._inflight[2], PendingSample):   # the tokens just read
                chained, batch, pending = self._inflight                                     # make its masks
                self._inflight = (chained, *self._sample_masked(chained, batch, pending.logits))
            if self._inflight_mixed is not None:   # its prefill time counts from here
                self._mixed_read = time.perf_counter()
            self._timing.finished()
            self._timing.record(bucket)
            t2 = time.perf_counter()
            if self._inflight is None:
                self._settle(seqs)
            else:   # the chained dispatch runs from the end of this one: expected, or seen if earlier
                self._timing.started(at=expected_end)
            ph["chain"] += t1 - t0
            ph["collect"] += t2 - t1
            ph["settle"] += time.perf_counter() - t2
            return deltas
        if self._inflight_mixed is not None:
            return self._step_mixed_ahead()
        if self._inflight_verify is not None:
            return self._step_verify_ahead()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        ph["schedule"] += t1 - t0
        if plan is None:
            return []
        # (a constrained sequence's drafts are cut to what its grammar allows; its verify rows get a mask each)
        drafts = self._drafts(plan) if self.speculator is not None else {}
        if drafts and plan.kind == "decode" and self.config.tuning.chain_verify:   # read back one step late
            self._inflight_verify = self._launch_verify(plan.chunks, drafts, dense=True)
            return []
        if drafts:
            deltas = self._verify(plan.chunks, drafts, dense=plan.kind == "decode")
            t2 = time.perf_counter()
            self._settle([s for s, _ in plan.chunks])
            ph["settle"] += time.perf_counter() - t2
            return deltas
        if plan.kind == "mixed" and self.config.tuning.overlap_mixed:   # read back one step late
            self._inflight_mixed = self._launch_mixed(plan.chunks)
            return []
        if plan.kind == "mixed":
            deltas = self._mixed_step(plan.chunks)
            t2 = time.perf_counter()
            self._settle([s for s, _ in plan.chunks])
            ph["settle"] += time.perf_counter() - t2
            return deltas
        seqs = [s for s, _ in plan.chunks]
        self._inflight = (seqs, *self._launch_decode(seqs))
        ph["chain"] += time.perf_counter() - t1
        return []

    @property
    def prefills_behind_decode(self) -> bool:
        """A newcomer's prompt step may be launched behind the decode dispatch in flight (overlap_mixed
        with prefill_behind_decode): a server need not let the dispatch finish before taking it in."""
        return bool(self.config.tuning.overlap_mixed and self.config.tuning.prefill_behind_decode)

    def _newcomers_fit(self) -> bool:
        """Whether waiting requests can be taken in now (a free row) and their prompt step launched
        before the decode dispatch in flight is read back."""
        s = self.scheduler
        return bool(self.prefills_behind_decode and self._inflight_mixed is None and s.waiting and s.free_rows)

    def _settle(self, seqs: list[Sequence]) -> None:
        """After a read-back with nothing in flight: register new full blocks, release the finished."""
        for seq in seqs:
            if seq.finish_reason != "abort":
                self.scheduler.register_blocks(seq)   # finished ones too: their blocks stay cached
            if seq.finish_reason is None:   # K/V behind every layer's window: their pages go back to the pool
                self.scheduler.free_behind_window(seq)
            if seq.finish_reason is not None:
                self.scheduler.release(seq)
                if self.speculator is not None:
                    self.speculator.forget(seq)

    def _chain(self, seqs: list[Sequence], advanced: DecodeBatch):
        """Start the next decode dispatch from `advanced` if the batch can stay as it is."""
        s, steps = self.scheduler, self.config.decode_steps
        if not self.config.tuning.overlap_decode or s.waiting and s.free_rows or len(s.running) != len(seqs):
            return None
        if any(seq.finish_reason is not None for seq in seqs):   # known finished: settle first
            return None
        constrained = any(seq.grammar is not None for seq in seqs)
        if self.speculator is not None and \
                self.speculator.would_draft(seqs, self.runner.batch_bucket(len(seqs))):
            return None
        if s.window:   # the pages behind every layer's window go back to the pool while the chain runs
            for seq in seqs:
                s.register_blocks(seq)
                s.free_behind_window(seq)
        # The host's view lags one dispatch: hold pages for two dispatches beyond it.
        need = {}
        for seq in seqs:
            last = min(len(seq.prompt_ids) + len(seq.output_ids) - 1 + 2 * steps, len(seq.prompt_ids) + seq.max_new)
            need[seq] = max(0, -(-last // self.config.page_size) - len(seq.pages))
        if sum(need.values()) > self.pages.num_free:
            return None
        # Built from the host's pages, not read from `advanced` (that read would wait for the dispatch).
        page_table = self.runner.empty_page_table(advanced.tokens.shape[0])
        for b, seq in enumerate(seqs):
            if need[seq]:
                seq.pages += self.pages.allocate(need[seq])
            page_table[b, :len(seq.pages)] = seq.pages
        advanced = advanced.replace(page_table=jax.device_put(page_table))
        if constrained:   # the forward pass now; masks and sampling after the read-back
            return seqs, advanced, PendingSample(self._forward_masked(advanced))
        advanced, outs = self._launch(advanced, seqs)
        return seqs, advanced, outs

    def _sampler(self, seqs: list[Sequence], rows: int, decode: bool) -> str:
        """The sampler variant for a step over these sequences (variants.choose_sampler)."""
        t = self.config.tuning
        return choose_sampler([seq.params for seq in seqs], rows, t.plain_sampling_step, decode=decode,
                              greedy_step=decode or t.greedy_mixed_step)

    def _launch_decode(self, seqs: list[Sequence]):
        r = self.runner
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
        self._decode_started = time.perf_counter()
        batch = to_device(DecodeBatch(**a, sampling=sampling))
        if any(seq.grammar is not None for seq in seqs):   # structured output: masks while its forward pass runs
            out = self._sample_masked(seqs, batch, self._forward_masked(batch))
        else:
            out = self._launch(batch, seqs)
        self._timing.started()
        return out

    def _forward_masked(self, batch: DecodeBatch) -> jax.Array:
        """A constrained decode step's forward pass (runner.launch_masked_forward), its host time fed to the
        dispatch timing. Its logits wait on the device for `_sample_masked`."""
        t0 = time.perf_counter()
        logits = self.runner.launch_masked_forward(batch)
        self._timing.launched(time.perf_counter() - t0)
        return logits

    def _sample_masked(self, seqs: list[Sequence], batch: DecodeBatch, logits: jax.Array):
        """Sample a constrained decode step whose forward pass is on the device: each sequence's mask for its next
        token (filled while the forward pass runs; a sequence known finished gets no mask, its token is dropped),
        then the sampling. Returns what `_launch` returns."""
        B = batch.tokens.shape[0]
        bitmask = self.constraints.bitmask([s.grammar if s.finish_reason is None else None for s in seqs], B, reuse=True)
        if bitmask is None:
            bitmask = self.constraints.allow_all(B)
        return self.runner.launch_masked_sample(batch, logits, bitmask, self._sampler(seqs, B, decode=True))

    def _launch(self, batch: DecodeBatch, seqs: list[Sequence]):
        """runner.launch_decode, its host time fed to the dispatch timing."""
        t0 = time.perf_counter()
        B = batch.tokens.shape[0]
        compiling = self.runner.first_call_seconds
        out = self.runner.launch_decode(batch, self.runner.decode_variant(self._sampler(seqs, B, decode=True), B))
        compiled = self.runner.first_call_seconds - compiling   # a step compiled on first use: not decode time
        self._decode_started += compiled
        self._timing.launched(time.perf_counter() - t0 - compiled)
        return out

    def _collect_decode(self, seqs: list[Sequence], outs) -> list[StreamDelta]:
        tokens, logprobs, emitted, top_v, top_i = self.runner.fetch(outs)
        now = time.perf_counter()
        if self.speculator is not None:
            self.speculator.measured("decode", self.runner.batch_bucket(len(seqs)), int(emitted.sum()),
                                     now - self._decode_started)
        self.stats["decode_seconds"] += now - self._decode_started
        self._decode_started = now
        deltas = []
        # rows as lists (numpy's per-row indexing, ~7 us a row, was most of a one-token row's cost)
        emitted_rows, token_rows, logprob_rows = emitted.T.tolist(), tokens.T.tolist(), logprobs.T.tolist()
        for b, seq in enumerate(seqs):
            if seq.finish_reason is not None:   # finished in the previous dispatch: drop what followed
                continue
            steps = [j for j, e in enumerate(emitted_rows[b]) if e]
            every = len(steps) == len(token_rows[b])
            self.stats["decode_tokens"] += len(steps)
            seq.num_computed += len(steps)
            tops = (top_v[steps, b], top_i[steps, b]) if seq.params.logprobs is not None else (None, None)
            deltas.append(self._append(seq, token_rows[b] if every else [token_rows[b][j] for j in steps],
                                       logprob_rows[b] if every else [logprob_rows[b][j] for j in steps], *tops))
            if seq.finish_reason is not None:
                self._finished[seq.request_id] = seq
        return deltas

    def _mixed_step(self, chunks: list[tuple[Sequence, int]]) -> list[StreamDelta]:
        return self._collect_mixed(self._launch_mixed(chunks))

    def _launch_mixed(self, chunks: list[tuple[Sequence, int]]) -> MixedInFlight:
        """Build a mixed step's arrays and start it on the device. The chunks' tokens count as computed
        from here on (a step planned ahead continues after them)."""
        r, ps = self.runner, self.config.page_size
        t_build = time.perf_counter()
        total = sum(n for _, n in chunks)
        bucket = r.token_bucket(total)
        next_tokens = np.zeros(bucket, np.int32)
        scored = self._prompt_rows(chunks, next_tokens)
        attention = "paged"
        # rows whose next token is constrained: their step is masked (and paged: a masked one-sequence step is not
        # compiled apart)
        emitting = [seq.grammar if seq.num_computed + n >= len(seq.tokens) else None for seq, n in chunks]
        masked = any(m is not None for m in emitting)
        if not scored and not masked and len(chunks) == 1 and r.has_one_sequence_step(bucket):   # one sequence's prompt
            attention = "fresh" if chunks[0][0].num_computed == 0 else \
                "prefixed" if self.config.tuning.prefixed_chunk_attention else "paged"
        rows = r.sampled_rows(attention)   # a one-sequence step's batch has one row
        a = r.empty_mixed(bucket, rows)
        a["next_tokens"] = next_tokens
        t = 0
        for b, (seq, n) in enumerate(chunks):
            start = seq.num_computed
            tokens = seq.tokens
            # A sequence whose token at `start` the step in flight is sampling (planned ahead): the
            # device reads it from the sampler state.
            pending = start == len(tokens)
            a["tokens"][t:t + n] = tokens[start:start + n] if not pending else 0
            a["from_state"][t:t + n] = pending
            a["positions"][t:t + n] = np.arange(start, start + n)
            a["slot_mapping"][t:t + n] = slots_for(seq.pages, start, start + n, ps)
            a["token_seq"][t:t + n] = b
            a["page_table"][b, :len(seq.pages)] = seq.pages
            a["sample_index"][b] = t + n - 1
            a["emits"][b] = pending or start + n >= len(tokens)
            a["state_row"][b] = seq.row
            a["step_index"][b] = len(seq.output_ids) + pending
            t += n
            a["query_start"][b + 1:] = t
        if "rope_long" in a:   # LongRoPE: every token of a long prompt takes the long factors (model/rotary.py)
            a["rope_long"][:len(chunks)] = [takes_long_factors(self.cfg, len(s.prompt_ids)) for s, _ in chunks]
        sampling = SamplingArrays.from_params([s.params for s, _ in chunks], [s.seed for s, _ in chunks], rows)
        bitmask = self.constraints.bitmask(emitting, rows) if masked else None
        t0 = time.perf_counter()
        batch = to_device_packed(StepBatch(**a, sampling=sampling, bitmask=bitmask))   # the step splits it (one argument)
        t1 = time.perf_counter()
        variant = StepVariant("prompt-logprobs", masked=masked) if scored else \
            StepVariant("mixed", self._sampler([s for s, _ in chunks], rows, decode=False), attention, masked=masked)
        compiling = r.first_call_seconds
        outs = r.launch_mixed(batch, variant)
        t0 += r.first_call_seconds - compiling   # a step compiled on first use: not prefill time
        self._observe(a)
        for seq, n in chunks:
            seq.num_computed += n
        self.phase_seconds["build"] += t1 - t_build
        self.phase_seconds["run"] += time.perf_counter() - t1
        return MixedInFlight(chunks, a["emits"][:len(chunks)].tolist(), scored, outs, t0, total)

    def _collect_mixed(self, step: MixedInFlight) -> list[StreamDelta]:
        """Read a mixed step back and append its tokens (not to sequences that ended meanwhile)."""
        t1 = time.perf_counter()
        out = self.runner.fetch(step.outs)
        tokens, logprobs, top_v, top_i = out[:4]
        t2 = time.perf_counter()
        self.stats["prefill_tokens"] += step.tokens
        seconds = t2 - max(step.launched, self._mixed_read)   # overlapping steps counted once
        self.stats["prefill_seconds"] += seconds
        self.mixed_step_times.append((self.runner.token_bucket(step.tokens), seconds))
        self._mixed_read = t2
        self.phase_seconds["run"] += t2 - t1
        for seq, row, pos in step.scored:   # the logprob of prompt token pos + 1, scored at row
            if len(seq.prompt_logprobs) == pos + 1:
                k = seq.params.prompt_logprobs
                top = [(int(i), float(v)) for i, v in zip(out[6][row][:k], out[5][row][:k])]
                seq.prompt_logprobs.append((float(out[4][row]), top))
        deltas = []
        for b, ((seq, _), emits) in enumerate(zip(step.chunks, step.emits)):
            if emits and seq.finish_reason is None:
                deltas.append(self._append(seq, tokens[b:b + 1], logprobs[b:b + 1], top_v[b:b + 1], top_i[b:b + 1]))
                if seq.finish_reason is not None:
                    self._finished[seq.request_id] = seq
        self.phase_seconds["append"] += time.perf_counter() - t2
        return deltas

    def _step_mixed_ahead(self) -> list[StreamDelta]:
        """With a mixed step in flight: plan and launch the next one before reading this one back (its
        prompt chunks need none of this step's tokens), then read this one back."""
        ph, t0 = self.phase_seconds, time.perf_counter()
        step, self._inflight_mixed = self._inflight_mixed, None
        pending = {seq for (seq, _), emits in zip(step.chunks, step.emits) if emits}
        plan = self.scheduler.schedule_ahead(pending)
        ph["schedule"] += time.perf_counter() - t0
        if plan is not None:
            self._inflight_mixed = self._launch_mixed(plan.chunks)
        deltas = self._collect_mixed(step)
        t2 = time.perf_counter()
        self._settle([s for s, _ in step.chunks])
        ph["settle"] += time.perf_counter() - t2
        return deltas

    @staticmethod
    def _prompt_rows(chunks: list[tuple[Sequence, int]], next_tokens: np.ndarray) -> list[tuple[Sequence, int, int]]:
        """Rows of this step whose next prompt token is to be scored (filling next_tokens in place):
        (sequence, token row, position)."""
        rows, t = [], 0
        for seq, n in chunks:
            if seq.params.prompt_logprobs is not None:
                for pos in range(seq.num_computed, min(seq.num_computed + n, len(seq.prompt_ids) - 1)):
                    next_tokens[t + pos - seq.num_computed] = seq.prompt_ids[pos + 1]
                    rows.append((seq, t + pos - seq.num_computed, pos))
            t += n
        return rows

    # ---- results ----
    def _append(self, seq: Sequence, new_ids, new_logprobs, top_values, top_ids) -> StreamDelta:
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        k = seq.params.logprobs
        text, accepted, lps, tops = "", [], [], []
        for j, tok in enumerate(int(t) for t in new_ids):
            seq.output_ids.append(tok)
            accepted.append(tok)
            lps.append(float(new_logprobs[j]))
            if k is not None:
                tops.append([(int(i), float(v)) for i, v in zip(top_ids[j][:k], top_values[j][:k])])
            grammar_done = advance(seq.grammar, tok) if seq.grammar is not None else None
            if tok in seq.stop_ids:
                seq.finish_reason = "stop"
            elif seq.detok is not None:
                emitted, hit = seq.stopper.feed(seq.detok.add([tok]))
                text += emitted
                if hit:
                    seq.finish_reason = "stop"
            if seq.finish_reason is None and grammar_done:   # the grammar is complete (or refused the token)
                seq.finish_reason = grammar_done
            if seq.finish_reason is None and len(seq.output_ids) >= seq.max_new:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                break
        if seq.finish_reason is not None and seq.detok is not None and not seq.stopper.stopped:
            emitted, _ = seq.stopper.feed(seq.detok.flush())   # a character left unfinished at the end
            text += emitted + seq.stopper.flush()
        seq.text += text
        seq.logprobs += lps
        seq.top_logprobs += tops
        return StreamDelta(seq.request_id, text, accepted, seq.finish_reason is not None, seq.finish_reason,
                           lps, tops if k is not None else None)

    def take_finished(self, request_id: int) -> RequestOutput:
        return output_of(self._finished.pop(request_id))

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is and free its pages at once."""
        s = self.scheduler
        for seq in [q for q in list(s.waiting) + list(s.running) if q.request_id == request_id]:
            # "abort" even where it had finished but not yet left (a step chained behind its last one in flight):
            # its pages go now, so the later settle must not register them in the prefix cache
            seq.finish_reason = "abort"
            s.release(seq)
            if self.speculator is not None:   # (a step in flight over it forgets it again when settled)
                self.speculator.forget(seq)
        self._finished.pop(request_id, None)


def _weakly(method):
    """A callback to a bound method that does not keep its object alive: an engine dropped by its
    user frees its device memory (weights, KV pool) at once, without waiting for a garbage collection."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)
