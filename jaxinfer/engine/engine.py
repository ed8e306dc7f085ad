"""LLM (offline API) and Engine (the schedule -> step -> update loop).

The scheduler (serve/scheduler.py) decides what the next step computes; the engine turns that
plan into padded step arrays, runs the compiled step on the ModelRunner, and turns sampled tokens
into text (incremental detokenization, stop tokens and strings, finish reasons):
- a *mixed* step carries prompt chunks (under a token budget) together with one decode token for
  each sequence already generating;
- a *decode* dispatch runs several decode steps on the device at once.
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
from typing import Iterable, Sequence as Seq

import jax
import numpy as np

from jaxinfer.runner.batch import StepBatch
from jaxinfer.model.config import ModelConfig, load_config
from jaxinfer.engine.dispatch_timing import DispatchTiming
from jaxinfer.runner.executable_cache import ExecutableCache
from jaxinfer.errors import JaxinferError, PromptTooLongError
from jaxinfer.model.kv_cache import bytes_per_page, check_kv_cache_dtype, kv_cache_dtype, slots_for
from jaxinfer.model.transformer import split_layers
from jaxinfer.ops import get_ops
from jaxinfer.engine.paging import PageAllocator
from jaxinfer.runner.transfer import to_device, to_device_packed
from jaxinfer.engine.scheduler import Scheduler, Sequence
from jaxinfer.runner.model_runner import DecodeBatch, ModelRunner
from jaxinfer.engine.generation_defaults import describe, read_generation_defaults
from jaxinfer.sampling.sampling import SamplingArrays, SamplingParams, sampler_for
from jaxinfer.text import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from jaxinfer.model.weights import load_params

MAX_STOP_IDS = 8
# Engine.phase_seconds: schedule (the scheduler's plan), build (a mixed step's arrays and their copy to
# the device), run (a mixed step's call and read-back: mostly waiting on the device), append (its tokens
# into text, stop checks), settle (prefix-cache blocks, releasing finished sequences), chain (building
# and launching a decode dispatch), collect (reading a decode dispatch back and appending its tokens).
STEP_PHASES = ("schedule", "build", "run", "append", "settle", "chain", "collect")


@dataclasses.dataclass
class EngineConfig:
    dtype: str = "float32"
    ops: str = "reference"
    max_model_len: int | None = None          # default: the model's max_position_embeddings
    max_num_seqs: int = 8
    # Token budget of a mixed step (prompt chunk size). None: 2048 on GPUs (a 1k-token prompt in one
    # step: each step also reads every weight and pays its launch), 512 on CPUs.
    max_num_batched_tokens: int | None = None
    page_size: int = 16
    kv_cache_dtype: str = "auto"              # "auto": the model's dtype; "fp8": float8 e4m3 (half the bytes)
    num_pages: int | None = None              # default: enough for max_num_seqs full-length sequences
    decode_steps: int = 8                     # decode steps per dispatch
    # Batches of at most this many sequences run dispatches of `short_decode_steps` instead: a request
    # that arrives while one runs waits for less of it (its time to first token), where the batch is
    # small enough for the host to launch and read back more often. 0: off.
    short_decode_max_batch: int = 0
    short_decode_steps: int = 2
    # A server chains the next decode dispatch this much earlier than the running one's expected end
    # less a launch (Engine.chain_at): the device idles less between dispatches when the estimate runs
    # late; a newcomer arriving in that window waits for the chained dispatch too. H200, Qwen3-4B shape,
    # 2 req/s, one call: TPOT p50 3.26 -> 3.09 ms with 1 ms, TTFT p50 26.2 -> 25.5 (bench/NOTES.md).
    chain_early_ms: float = 1.0
    token_buckets: list[int] | None = None    # mixed-step sizes to compile (default: powers of two up to the budget)
    # Layers as straight-line code over per-layer weight arrays (no device loop, no weight copies in
    # XLA's GEMMs; longer compiles). None: on GPUs, where both costs were measured (bench/NOTES.md).
    unroll_layers: bool | None = None
    max_logprobs: int = 20                    # top logprobs computed per sampled token
    enable_prefix_caching: bool = True
    enable_prompt_logprobs: bool = False      # compile the mixed steps that also score every prompt token
    overlap_decode: bool = True               # read decode dispatches back one dispatch late
    # Read mixed (prompt) steps back one step late: the next one, planned from what is known before
    # (prompt chunks; decodes of sequences not waiting on the step in flight), is launched first, so
    # the host's work between steps overlaps the device's. A step waits on its sampling branch's
    # predicate unless it runs the greedy-only variant (greedy_mixed_step). None: on GPUs (H200, Qwen3-4B
    # shape: +10% offline and +8.5% through the server with 64 requests at once, bench/NOTES.md).
    overlap_mixed: bool | None = None
    # With overlap_mixed: a newcomer's prompt step is launched behind the decode dispatch in flight,
    # before that dispatch is read back (off: after it, as without overlap_mixed). None: on GPUs (H200,
    # Qwen3-4B shape, 2 req/s: queue 4.5 -> 0.8 ms, TTFT p50 32.5 -> 24.6 ms, bench/NOTES.md).
    prefill_behind_decode: bool | None = None
    # A greedy-only mixed step per token bucket, run when every row is greedy and wants no top logprobs:
    # no sampling branch, whose predicate the GPU runtime reads back mid-step (the call blocked until
    # the prefill was nearly done). None: on GPUs (one more executable per token bucket).
    greedy_mixed_step: bool | None = None
    # The mixed steps write their sampled tokens (and logprobs) to pinned host memory as their last work, so
    # reading a prompt's first token back needs no device-to-host copy dispatched after the step ends
    # (bench variant host-outputs; twenty-third session).
    mixed_outputs_on_host: bool = False
    # A one-sequence prompt step (fresh_prompt_attention's) as two executables, the first this many layers,
    # the rest and the sampling (runner.SplitStep): the device can start on the first's small CUDA graph while
    # the host launches the second's. 0: one executable. None: 6 on GPUs (H200, Qwen3-4B, 1k prompt, one
    # process each: TTFT 14.04 / 14.26 -> 13.70 / 14.01 ms, bench/prefill.py 70.3 -> 71.1% of the GEMM rate;
    # bench/NOTES.md, twenty-fourth session).
    prompt_step_head_layers: int | None = None
    # The sampling steps (a row sampled, or top logprobs wanted) in four variants the host picks between
    # (sampling.sampler_for), none with a device-side conditional: three without the sort over the
    # vocabulary, "-plain" for steps whose sampled rows use neither top-k nor top-p (temperature, min-p,
    # penalties, greedy rows wanting logprobs), "-filter" for steps whose rows with top-k or top-p all have
    # a top-k of at most 64 (top-p with it), "-filter-p" where others have top-p alone (a radix search for
    # the nucleus), and one that sorts (a top-k above 64, or top-p alone in a step of at most 2 rows). Off:
    # one sampling variant, which skips the sort behind a conditional when every row is greedy; the GPU runtime reads
    # its predicate back mid-call, so the call blocks until the forward pass is done (no overlap). None:
    # on GPUs (H200, Qwen3-4B, temperature 0.8 at 2 req/s: TTFT p50 36.6 -> 27.4 ms, TPOT 3.87 -> 3.17 ms;
    # bench/NOTES.md, tenth session).
    plain_sampling_step: bool | None = None
    # A prompt step that is one prompt from position 0 (the light-load case; not one scoring its prompt)
    # of at least fresh_prompt_min_tokens runs attention as jax.nn.dot_product_attention on its own rows
    # (cuDNN's flash attention on GPUs) instead of the paged kernel: a "-fresh" variant of the sampling
    # and the greedy-only step for each such token bucket.
    # None: on GPUs (H200, Qwen3-4B shape: per layer 0.034 against 0.060 ms at 1,024 tokens, 0.98
    # against 1.89 at 8,192, but 0.039 against 0.006 at 128; bench/NOTES.md).
    fresh_prompt_attention: bool | None = None
    fresh_prompt_min_tokens: int = 1024
    # With fresh_prompt_attention: a step (of as many tokens) that is one sequence's chunk after its cached
    # prefix (a long prompt's later chunks; a prefix-cache hit) runs attention as two cuDNN flash attentions
    # (over the prefix, gathered at the page table's full span; over the chunk, causal) merged by their
    # log-sum-exps. None: on GPUs (H200, Qwen3-4B shape, per layer: a 1,024-token chunk after 1,024 0.091
    # against the paged kernel's 0.124 ms, 2,048 after 30,720 1.95 against 3.69; the 32k prefill 1.37 -> 0.97 s;
    # bench/NOTES.md, tenth session).
    prefixed_chunk_attention: bool | None = None
    gpu_memory_fraction: float = 0.9          # of device memory for weights + KV pool (where the device reports it)
    seed: int = 0                             # seeds requests that bring none
    skip_tokenizer_init: bool = False         # token ids in and out only (no tokenizer.json needed)
    # Sampling defaults for requests that bring no SamplingParams (and, through the server, for the fields
    # a request leaves out), as vLLM applies them: "auto" (the model's generation_config.json), "none"
    # (the library's: temperature 1, no filters), or a folder holding a generation_config.json.
    generation_config: str | None = "auto"
    progress: bool = True
    compilation_cache: str | None = os.path.expanduser("~/.cache/jaxinfer/jax")   # JAX's, keyed by the lowered step
    # Whole executables keyed by source, versions and shapes: a warm start skips tracing and lowering.
    # None: ~/.cache/jaxinfer/executables on GPUs, off on CPUs (XLA:CPU executables loaded back can
    # miss their kernels: "Function wrapped_iota not found", jax 0.11.2); "" turns it off.
    executable_cache: str | None = None
    # Steps compiled side by side at start-up; None: up to 8 on GPUs (half the host's cores), 1 on CPUs.
    compile_threads: int | None = None
    # Compile every step's shape buckets at start-up (a server then never compiles while serving). False:
    # each compiles when first used, so start-up is quick and only the shapes used are compiled (tests,
    # short scripts: a GPU engine has ~80 steps to compile, ~2 min cold for Qwen3-4B).
    compile_at_start: bool = True

    def for_backend(self, backend: str) -> "EngineConfig":
        """This config with the backend-dependent defaults (the fields left None) filled in: on GPUs,
        layers unrolled over per-layer weights, a 2,048-token step budget, parallel compilation and
        the executable cache."""
        gpu = backend == "gpu"
        defaults = dict(unroll_layers=gpu, max_num_batched_tokens=2048 if gpu else 512, greedy_mixed_step=gpu,
                        overlap_mixed=gpu, prefill_behind_decode=gpu, fresh_prompt_attention=gpu,
                        prefixed_chunk_attention=gpu, plain_sampling_step=gpu,
                        prompt_step_head_layers=6 if gpu else 0,
                        compile_threads=min(8, (os.cpu_count() or 2) // 2) if gpu else 1,
                        executable_cache=os.path.expanduser("~/.cache/jaxinfer/executables") if gpu else "")
        return dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "decode_steps", "compile_threads",
                     "short_decode_steps", "fresh_prompt_min_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.prompt_step_head_layers is not None and self.prompt_step_head_layers < 0:
            raise ValueError(f"prompt_step_head_layers must be >= 0, got {self.prompt_step_head_layers}")
        if self.chain_early_ms < 0:
            raise ValueError(f"chain_early_ms must be >= 0, got {self.chain_early_ms}")
        if self.short_decode_max_batch < 0:
            raise ValueError(f"short_decode_max_batch must be >= 0, got {self.short_decode_max_batch}")
        if self.short_decode_max_batch and self.short_decode_steps > self.decode_steps:
            raise ValueError(f"short_decode_steps ({self.short_decode_steps}) must be at most decode_steps "
                             f"({self.decode_steps})")


@dataclasses.dataclass
class MixedInFlight:
    """A mixed step launched and not yet read back."""

    chunks: list[tuple[Sequence, int]]
    emits: list[bool]          # per chunk: this step samples the sequence's next token
    scored: list               # prompt-logprob rows (Engine._prompt_rows)
    outs: tuple                # device arrays: tokens, logprobs, top values, top ids (, prompt logprobs)
    launched: float            # perf_counter before the launch
    tokens: int                # prompt and decode tokens computed


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
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list | None = None   # per prompt token: None (the first), else (logprob, top list)


@dataclasses.dataclass
class StreamDelta:
    """What one engine step added to one request."""

    request_id: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None   # per new token, when params.logprobs asked


def _output(seq: Sequence) -> RequestOutput:
    return RequestOutput(seq.request_id, seq.prompt, seq.prompt_ids, seq.text, list(seq.output_ids),
                         list(seq.logprobs), seq.finish_reason, seq.finish_reason is not None,
                         list(seq.top_logprobs) if seq.params.logprobs is not None else None,
                         list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None)


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, **overrides):
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.config = config = config.for_backend(jax.default_backend())
        config.validate()
        if config.compilation_cache:
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        t0 = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.cfg: ModelConfig = load_config(model_dir, config.dtype)
        self.tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_dir(model_dir)
        self.sampling_defaults = read_generation_defaults(config.generation_config, model_dir)
        self.max_model_len = min(config.max_model_len or self.cfg.max_position_embeddings,
                                 self.cfg.max_position_embeddings)
        params = load_params(model_dir, self.cfg, progress=config.progress)
        if config.unroll_layers:
            params = split_layers(params)
        self.kv_dtype = kv_cache_dtype(self.cfg, config.kv_cache_dtype)
        num_pages = self._num_pages()
        self.runner = ModelRunner(self.cfg, params, get_ops(config.ops), num_pages=num_pages,
                                  page_size=config.page_size, max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  steps_per_decode=config.decode_steps, token_buckets=config.token_buckets,
                                  short_decode=(config.short_decode_max_batch, config.short_decode_steps),
                                  unroll_layers=config.unroll_layers, max_logprobs=config.max_logprobs,
                                  prompt_logprobs=config.enable_prompt_logprobs,
                                  executable_cache=ExecutableCache(config.executable_cache)
                                  if config.executable_cache else None, kv_dtype=self.kv_dtype,
                                  greedy_mixed=config.greedy_mixed_step,
                                  fresh_prompt_min_tokens=config.fresh_prompt_min_tokens
                                  if config.fresh_prompt_attention else 0,
                                  prefixed_chunks=bool(config.fresh_prompt_attention and
                                                       config.prefixed_chunk_attention),
                                  plain_sampling=config.plain_sampling_step,
                                  mixed_outputs_on_host=config.mixed_outputs_on_host,
                                  prompt_head_layers=config.prompt_step_head_layers)
        self.pages = PageAllocator(num_pages)
        self.kv_bytes = num_pages * bytes_per_page(self.cfg, config.page_size, self.kv_dtype)
        self.load_seconds = time.perf_counter() - t0
        self.compile_seconds = self.runner.warmup(progress=config.progress, threads=config.compile_threads,
                                                  compile=config.compile_at_start)
        if config.progress:
            print(f"[KV cache: {num_pages - 1} pages of {config.page_size} tokens = "
                  f"{(num_pages - 1) * config.page_size:,} tokens ({self.kv_bytes / 2**20:,.1f} MiB, "
                  f"{jax.numpy.dtype(self.kv_dtype).name}); "
                  f"loaded in {self.load_seconds:.1f} s, compiled in {self.compile_seconds:.1f} s "
                  f"({', '.join(f'{k} {v:.1f} s' for k, v in self.runner.warmup_breakdown.items())})]", file=sys.stderr)
            if self.sampling_defaults:
                print(f"[sampling defaults from generation_config.json: {describe(self.sampling_defaults)} "
                      "(--generation-config none for the library's)]", file=sys.stderr)
        self.scheduler = Scheduler(self.pages, config.page_size, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.decode_steps, on_start=_weakly(self._on_start),
                                   prefix_caching=config.enable_prefix_caching,
                                   token_buckets=self.runner.token_buckets)
        self._finished: dict[int, Sequence] = {}
        self._inflight: tuple | None = None      # a decode dispatch not yet read back
        self._inflight_mixed: MixedInFlight | None = None   # a mixed step not yet read back (overlap_mixed)
        self._mixed_read = 0.0                   # when the last mixed step was read back
        self._decode_started = 0.0
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
        use (the rest keeps prefix-cached pages; more would only take memory the steps need: a
        one-sequence engine on the H200 took 90% of the card and its 2,048-token step then could not
        get its 42.5 GiB of temporaries); else enough for max_num_seqs full-length sequences."""
        c = self.config
        pages_per_seq = -(-self.max_model_len // c.page_size)
        num_pages = c.num_pages
        stats = jax.devices()[0].memory_stats() if num_pages is None else None
        if num_pages is None and stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] * c.gpu_memory_fraction - stats.get("bytes_in_use", 0)
            # Leave room for the activations of the largest step.
            free -= 4 * c.max_num_batched_tokens * (self.cfg.hidden_size * 8 + self.cfg.vocab_size)
            num_pages = min(int(free // bytes_per_page(self.cfg, c.page_size, self.kv_dtype)),
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

    def _on_start(self, seq: Sequence) -> None:
        # The sampler row's prompt mask and output counts matter only to a request with a penalty: without
        # one, apply_penalties returns the logits unchanged whatever the row holds (left by the row's last
        # sequence). Skipping the reset saves its copy and dispatch: start_sequence took 0.58 ms of host
        # time per request on the H200 host (bench/host_prompt_step.py, twelfth session).
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
            raise PromptTooLongError(f"prompt has {len(ids)} tokens; the context window is {self.max_model_len} "
                                     "and at least one token must be generated")
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            eos = (self.tokenizer.eos_token_ids if self.tokenizer else ()) + self.cfg.eos_token_ids
            stop_ids += [t for t in dict.fromkeys(eos) if t not in stop_ids]
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_IDS - len(self.cfg.eos_token_ids)} are supported")
        seq = Sequence(
            request_id=next(self._ids), prompt=text, prompt_ids=ids, params=params,
            seed=params.seed if params.seed is not None else self._rng.getrandbits(32),
            max_new=min(params.max_tokens, self.max_model_len - len(ids)), stop_ids=stop_ids,
            detok=IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None,
            stopper=StopStringMatcher(params.stop or []),
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
        then (bench/NOTES.md: a launch blocks the host ~1 step, which a wait-then-launch loop exposes)."""
        if self._inflight is None:
            return None
        return self._timing.chain_at(self.runner.batch_bucket(len(self._inflight[0])),
                                     early=self.config.chain_early_ms / 1e3)

    def inflight_done(self) -> bool:
        """Whether the decode dispatch in flight has finished on the device (no wait); its end is
        timed the first time this sees it."""
        if self._inflight is None or not self._inflight[2][0].is_ready():
            return False
        self._timing.finished()
        return True

    def has_unfinished(self) -> bool:
        return self._inflight is not None or self._inflight_mixed is not None or self.scheduler.has_work()

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
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        ph["schedule"] += t1 - t0
        if plan is None:
            return []
        if plan.kind == "mixed" and self.config.overlap_mixed:   # read back one step late
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
        return bool(self.config.overlap_mixed and self.config.prefill_behind_decode)

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
            if seq.finish_reason is not None:
                self.scheduler.release(seq)

    def _chain(self, seqs: list[Sequence], advanced: DecodeBatch):
        """Start the next decode dispatch from `advanced` if the batch can stay as it is."""
        s, steps = self.scheduler, self.config.decode_steps
        if not self.config.overlap_decode or s.waiting and s.free_rows or len(s.running) != len(seqs):
            return None
        if any(seq.finish_reason is not None for seq in seqs):   # known finished: settle first
            return None
        # The host's view lags one dispatch: hold pages for two dispatches beyond it.
        need = {}
        for seq in seqs:
            last = min(len(seq.tokens) - 1 + 2 * steps, len(seq.prompt_ids) + seq.max_new)
            need[seq] = max(0, -(-last // self.config.page_size) - len(seq.pages))
        if sum(need.values()) > self.pages.num_free:
            return None
        # Built from the host's pages, not read from `advanced` (that read would wait for the dispatch).
        page_table = self.runner.empty_page_table(advanced.tokens.shape[0])
        for b, seq in enumerate(seqs):
            if need[seq]:
                seq.pages += self.pages.allocate(need[seq])
            page_table[b, :len(seq.pages)] = seq.pages
        advanced, outs = self._launch(advanced.replace(page_table=jax.device_put(page_table)), seqs)
        return seqs, advanced, outs

    def _sampler(self, seqs: list[Sequence], rows: int, decode: bool = False) -> str | None:
        """The sampling step variant for these sequences in a step sampling `rows` rows: with
        plain_sampling_step, "plain", "filter" or "filter-p" (no sort) where sampling.sampler_for allows, else None
        (the sorting one). A decode dispatch whose rows want no top logprobs takes "plain-notop" for "plain"."""
        if not self.config.plain_sampling_step:
            return None
        method = sampler_for([seq.params for seq in seqs], rows)
        if decode and method == "plain" and not any(seq.params.logprobs for seq in seqs):
            return "plain-notop"    # no top logprobs to compute
        return None if method == "sort" else method

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
        out = self._launch(to_device(DecodeBatch(**a, sampling=sampling)), seqs)
        self._timing.started()
        return out

    def _launch(self, batch: DecodeBatch, seqs: list[Sequence]):
        """runner.launch_decode, its host time fed to the dispatch timing."""
        t0 = time.perf_counter()
        greedy = _all_greedy(seqs)
        sampler = None if greedy else self._sampler(seqs, batch.tokens.shape[0], decode=True)
        out = self.runner.launch_decode(batch, greedy=greedy, sampler=sampler)
        self._timing.launched(time.perf_counter() - t0)
        return out

    def _collect_decode(self, seqs: list[Sequence], outs) -> list[StreamDelta]:
        tokens, logprobs, emitted, top_v, top_i = self.runner.fetch(outs)
        now = time.perf_counter()
        self.stats["decode_seconds"] += now - self._decode_started
        self._decode_started = now
        deltas = []
        for b, seq in enumerate(seqs):
            steps = np.nonzero(emitted[:, b])[0]
            if seq.finish_reason is not None:   # finished in the previous dispatch: drop what followed
                continue
            self.stats["decode_tokens"] += len(steps)
            seq.num_computed += len(steps)
            deltas.append(self._append(seq, tokens[steps, b], logprobs[steps, b], top_v[steps, b], top_i[steps, b]))
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
        if not scored and len(chunks) == 1 and r.has_one_sequence_step(bucket):   # one sequence's prompt
            attention = "fresh" if chunks[0][0].num_computed == 0 else \
                "prefixed" if self.config.prefixed_chunk_attention else "paged"
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
        sampling = SamplingArrays.from_params([s.params for s, _ in chunks], [s.seed for s, _ in chunks], rows)
        t0 = time.perf_counter()
        greedy = self.config.greedy_mixed_step and not scored and _all_greedy([s for s, _ in chunks])
        batch = to_device_packed(StepBatch(**a, sampling=sampling))   # the step splits it (one argument)
        t1 = time.perf_counter()
        sampler = None if scored or greedy else self._sampler([s for s, _ in chunks], rows)
        outs = r.launch_mixed(batch, prompt_logprobs=bool(scored), greedy=greedy, attention=attention, sampler=sampler)
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
        seq.logprobs += lps
        seq.top_logprobs += tops
        return StreamDelta(seq.request_id, text, accepted, seq.finish_reason is not None, seq.finish_reason,
                           lps, tops if k is not None else None)

    def take_finished(self, request_id: int) -> RequestOutput:
        return _output(self._finished.pop(request_id))

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is and free its pages at once."""
        s = self.scheduler
        for seq in [q for q in list(s.waiting) + list(s.running) if q.request_id == request_id]:
            seq.finish_reason = seq.finish_reason or "abort"
            s.release(seq)
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
                ids.append(self.engine.add_request(p, sp or self.engine.default_sampling_params()))
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


def _all_greedy(seqs: list[Sequence]) -> bool:
    """The batch can run a greedy-only step variant: argmax rows, no top logprobs wanted."""
    return all(seq.params.temperature == 0 and not seq.params.logprobs for seq in seqs)


def _weakly(method):
    """A callback to a bound method that does not keep its object alive: an engine dropped by its
    user frees its device memory (weights, KV pool) at once, without waiting for a garbage collection."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)
