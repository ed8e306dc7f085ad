"""ModelRunner: parameters, KV pages and sampler state on the device, and the compiled steps over them.

Each step variant (variants.py) is a jitted pure function (steps.py) with the KV cache and sampler state
donated, compiled once per shape bucket: a mixed step's token count, a decode dispatch's batch size. An
engine that serves compiles every bucket at start-up (`warmup(compile=True)`: no request then waits on a
compile); one-shot use compiles each executable on its first call. Either way an executable is loaded
from the executable cache where an earlier process saved it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from types import ModuleType
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxinfer.errors import DeviceMemoryError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kv_cache import SCRATCH_PAGE
from jaxinfer.model.tensor_parallel import allocate_kv
from jaxinfer.runner.batch import DecodeBatch, SamplerState, StepBatch, VerifyBatch
from jaxinfer.runner.compiler_options import step_compiler_options, step_jit
from jaxinfer.runner.executable_cache import ExecutableCache
from jaxinfer.runner.split_step import SplitStep
from jaxinfer.runner.steps import (decode_forward, decode_sample, decode_steps, init_row, mixed_step,
                                   mixed_step_prompt_logprobs, verify_step)
from jaxinfer.runner.transfer import Packed, to_device, to_device_packed
from jaxinfer.runner.variants import StepKey, StepVariant, samplers_built
from jaxinfer.sampling.choose import filter_pays
from jaxinfer.sampling.sample import SamplingArrays
from jaxinfer.settings import EngineConfig


def verify_widths(num_speculative_tokens: int | None) -> tuple[int, ...]:
    """The rows a sequence scores (Q) in the compiled verify steps: k + 1 for the most drafts k, and 2 (one
    draft) for batches too large to verify more at no cost. Empty without speculative decoding."""
    if not num_speculative_tokens:
        return ()
    return tuple(sorted({2, num_speculative_tokens + 1}))


def bucket_of(batch: StepBatch | DecodeBatch | VerifyBatch | Packed) -> int:
    """A batch's bucket: its leading size (tokens of a mixed step, rows of a decode dispatch)."""
    return batch.field_shape("tokens")[0] if isinstance(batch, Packed) else batch.tokens.shape[0]


def pow2_buckets(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


class ModelRunner:
    """Owns the device state (params, KV cache, sampler state) and the compiled steps."""

    def __init__(self, cfg: ModelConfig, params: dict, ops: ModuleType, config: EngineConfig, *, num_pages: int,
                 max_model_len: int, kv_dtype=None, executable_cache: ExecutableCache | None = None,
                 capture_layers: tuple[int, ...] = ()):
        """config: resolved (EngineConfig.resolved). kv_dtype: the KV cache's (default the model's). capture_layers:
        target layers whose outputs the prompt and verify steps also return (for a DFlash drafter), left on the
        device in `captured` after each such step."""
        t = config.tuning
        self.cfg, self.params, self.ops, self.tuning = cfg, params, ops, t
        self.page_size = config.page_size
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = max_model_len
        self.max_logprobs = config.max_logprobs
        self.pages_per_seq = -(-max_model_len // config.page_size)
        self.steps_per_decode = config.decode_steps
        budget = config.max_num_batched_tokens
        self.token_buckets = sorted(set(t.token_buckets) | {budget}) if t.token_buckets else \
            pow2_buckets(min(16, budget), budget)
        self.batch_buckets = pow2_buckets(1, config.max_num_seqs)
        self.kv = allocate_kv(cfg, getattr(ops, "mesh", None), num_pages, config.page_size, kv_dtype)
        self.num_pages = num_pages
        self.state = SamplerState.allocate(config.max_num_seqs + 1, cfg.vocab_size)
        self.scratch_row = config.max_num_seqs
        self.device_wait_seconds = 0.0   # time the host spent blocked on the device (read-backs, waits)
        self.warmup_breakdown: dict[str, float] = {}
        self.fresh_prompt_min_tokens = t.fresh_prompt_min_tokens if t.fresh_prompt_attention else 0
        self.steps: dict[StepVariant, Any] = {}   # each called as steps[v](params, kv, state, batch)
        self.capture_layers = tuple(capture_layers)
        self.captured: jax.Array | None = None   # [len(capture_layers), T, D] of the last prompt or verify step
        unroll, n_top = t.unroll_layers, config.max_logprobs
        # the options of the steps whose fp8 products run XLA's W8A8 (tables.FP8_W8A8_ROWS rows or more), if any
        self.compiler_options = step_compiler_options(params)
        jit = step_jit(self.compiler_options, bucket_of)
        for n in {self.decode_steps_for(b) for b in self.batch_buckets}:
            for sampler in samplers_built(t.plain_sampling_step, None, decode=True):
                v = StepVariant("decode", sampler, steps=n)
                self.steps[v] = jit(functools.partial(decode_steps, cfg, ops, n, unroll, v.n_top(n_top), v.greedy,
                                                      method=v.method), donate_argnums=(1, 2))
        attentions = ["paged"] + ["fresh"] * (self.fresh_prompt_min_tokens > 0) + \
            ["prefixed"] * bool(self.fresh_prompt_min_tokens and t.prefixed_chunk_attention)
        for attention in attentions:
            rows = self.sampled_rows(attention)
            for sampler in samplers_built(t.plain_sampling_step, rows, decode=False, greedy_step=t.greedy_mixed_step):
                v = StepVariant("mixed", sampler, attention)
                if v.one_sequence and 0 < t.prompt_step_head_layers < cfg.num_layers and not capture_layers:
                    self.steps[v] = SplitStep(cfg, ops, v.n_top(n_top), t.prompt_step_head_layers, v.greedy,
                                              attention, v.method, jit=jit)
                    continue
                step = functools.partial(mixed_step, cfg, ops, v.n_top(n_top), greedy=v.greedy, attention=attention,
                                         method=v.method, capture=self.capture_layers)
                self.steps[v] = jit(step, donate_argnums=(1, 2))
        self.verify_widths = verify_widths(config.num_speculative_tokens if config.speculative else None)
        for width in self.verify_widths:
            for sampler in ("greedy", "sort"):
                attentions = ("paged", "verify") if width == max(self.verify_widths) else ("verify",)
                for attention in attentions:
                    v = StepVariant("verify", sampler, attention, steps=width)
                    self.steps[v] = jit(functools.partial(verify_step, cfg, ops, v.n_top(n_top), greedy=v.greedy,
                                                          attention=attention, method=v.method,
                                                          capture=self.capture_layers),
                                        donate_argnums=(1, 2))
        if config.enable_prompt_logprobs:
            self.steps[StepVariant("prompt-logprobs")] = jit(
                functools.partial(mixed_step_prompt_logprobs, cfg, ops, n_top), donate_argnums=(1, 2))
        # a constrained decode step, in two dispatches (steps.decode_forward, decode_sample by sampler), compiled on
        # first use
        self._masked_forward = jit(functools.partial(decode_forward, cfg, ops, unroll), batch_arg=2,
                                   donate_argnums=(1,))
        self._masked_samples: dict[str, Any] = {}
        self._init_row = jax.jit(init_row, donate_argnums=(0,))
        # What the steps are built from besides their arguments and the kernel tables (FP8_W8A8_ROWS, which picks
        # the steps the options apply to, among them): the executable cache's key.
        self._settings = repr((cfg, getattr(ops, "name", getattr(ops, "__name__", None)), unroll, n_top,
                               t.plain_sampling_step, t.prompt_step_head_layers, self.compiler_options))
        self.executable_cache = executable_cache
        self._executables: dict[StepKey, Any] = {}   # loaded or compiled, by variant, bucket and part
        self._called: set[tuple[StepVariant, int]] = set()
        self.first_call_seconds = 0.0   # first calls of a step at a bucket after warm-up: compiling or loading it

    def step_of(self, variant: StepVariant):
        """The step function of a variant. A masked one (its batch carries a structured-output bitmask) is its
        unmasked twin's jitted function (the batch's bitmask field is a pytree leaf of its own, so it traces and
        compiles apart, on first use: not at warm-up)."""
        return self.steps[dataclasses.replace(variant, masked=False) if variant.masked else variant]

    def decode_steps_for(self, batch_bucket: int) -> int:
        """Decode steps in one dispatch of a batch of this bucket."""
        t = self.tuning
        return t.short_decode_steps if batch_bucket <= t.short_decode_max_batch else self.steps_per_decode

    def decode_variant(self, sampler: str, batch_bucket: int) -> StepVariant:
        return StepVariant("decode", sampler, steps=self.decode_steps_for(batch_bucket))

    def token_bucket(self, n: int) -> int:
        return next(b for b in self.token_buckets if b >= n)

    def batch_bucket(self, n: int) -> int:
        return next(b for b in self.batch_buckets if b >= n)

    def sampled_rows(self, attention: str) -> int:
        """Rows a mixed step of this attention carries and samples: a one-sequence step its one."""
        return self.max_num_seqs if attention == "paged" else 1

    def has_one_sequence_step(self, tokens: int) -> bool:
        """Whether a step of this many tokens that is one sequence's prompt runs a "fresh" (or, if compiled,
        "prefixed") variant."""
        return 0 < self.fresh_prompt_min_tokens <= self.token_bucket(tokens)

    def start_sequence(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Reset the sampler row of a sequence that (re)enters the batch."""
        ids = np.zeros(self.max_model_len, np.int32)
        tokens = (prompt_ids + output_ids)[: self.max_model_len]
        ids[: len(tokens)] = tokens
        self.state = self._init_row(self.state, *to_device((np.int32(row), ids, np.int32(len(prompt_ids)),
                                                            np.int32(len(tokens)))))

    # ---- running steps ----
    def launch_mixed(self, batch: StepBatch, variant: StepVariant) -> tuple:
        """Start a mixed step: its outputs on the device, not yet read back: tokens [B], logprobs [B], top
        logprob values [B, K], top ids [B, K]; a prompt-logprobs step also next-token logprobs [T] and top
        values, ids [T, K] of every row. A "branch" sampler blocks until its branch is chosen (GPU)."""
        t0 = time.perf_counter()
        self.kv, self.state, *out = self._call(variant, batch)
        self.device_wait_seconds += time.perf_counter() - t0
        return self._keep_captured(out, variant)

    def _keep_captured(self, out: list, variant: StepVariant) -> tuple:
        """A step's outputs less the captured layer states, which stay on the device in `captured`."""
        if self.capture_layers and variant.phase in ("mixed", "verify"):
            self.captured = out.pop()
        return tuple(out)

    def launch_verify(self, batch: VerifyBatch, variant: StepVariant) -> tuple:
        """Start a verify step: its outputs on the device: accepted drafts [B], tokens [B, Q], logprobs [B, Q],
        top values and ids [B, Q, K]. (The same call as a mixed step's.)"""
        return self.launch_mixed(batch, variant)

    def launch_decode(self, batch: DecodeBatch, variant: StepVariant) -> tuple[DecodeBatch, tuple[jax.Array, ...]]:
        """Start a decode dispatch without waiting for it: (the advanced batch, on device; outputs, on
        device: tokens, logprobs, emitted [n, B], top values, top ids [n, B, K])."""
        self.kv, self.state, advanced, *out = self._call(variant, batch)
        return advanced, tuple(out)

    def launch_masked_forward(self, batch: DecodeBatch) -> jax.Array:
        """Start a constrained decode step (structured output) with its forward pass: the logits [B, V], left on
        the device for `launch_masked_sample`."""
        self.kv, logits = self._masked_forward(self.params, self.kv, batch)
        return logits

    def launch_masked_sample(self, batch: DecodeBatch, logits: jax.Array, bitmask, sampler: str
                             ) -> tuple[DecodeBatch, tuple[jax.Array, ...]]:
        """Sample a constrained decode step under the host's bitmask [B, ceil(V / 32)] int32: what launch_decode
        returns for a one-step dispatch."""
        fn = self._masked_samples.get(sampler)
        if fn is None:
            v = StepVariant("decode", sampler)
            fn = jax.jit(functools.partial(decode_sample, v.n_top(self.max_logprobs), v.greedy, v.method),
                         donate_argnums=(0,))   # no products: the options never apply
            self._masked_samples[sampler] = fn
        self.state, advanced, *out = fn(self.state, batch, logits, bitmask)
        return advanced, tuple(out)

    def run_mixed(self, batch: StepBatch, variant: StepVariant) -> tuple[np.ndarray, ...]:
        return self.fetch(self.launch_mixed(batch, variant))

    def run_decode(self, batch: DecodeBatch, variant: StepVariant) -> tuple[np.ndarray, ...]:
        return self.fetch(self.launch_decode(batch, variant)[1])

    def fetch(self, arrays) -> tuple[np.ndarray, ...]:
        """Read device arrays back, counting the time spent waiting in `device_wait_seconds`."""
        t0 = time.perf_counter()
        with self._out_of_memory_explained():   # a step's allocation failure surfaces here, at the read-back
            out = tuple(jax.device_get(list(arrays)))   # the copies start together, not one after another
        self.device_wait_seconds += time.perf_counter() - t0
        return out

    def wait(self, arrays) -> None:
        """Block until device arrays are computed (no read-back), counted as `fetch` counts."""
        t0 = time.perf_counter()
        with self._out_of_memory_explained():
            jax.block_until_ready(arrays)
        self.device_wait_seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def _out_of_memory_explained(self):
        """XLA's RESOURCE_EXHAUSTED as a DeviceMemoryError that says what holds the memory and what frees some."""
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            first = str(e).strip().splitlines()[0][:300]
            pool = sum(a.nbytes for a in jax.tree.leaves(self.kv)) / 2 ** 30   # shapes: whether donated or not
            raise DeviceMemoryError(
                f"a step ran out of device memory ({first}); the KV pool holds {pool:.1f} GiB ({self.num_pages} "
                f"pages): lower gpu_memory_fraction, max_num_seqs or max_model_len (or set num_pages) to leave the "
                f"steps more room") from e

    def _call(self, variant: StepVariant, batch: StepBatch | DecodeBatch):
        """Run a step on (params, kv, state, batch) with its executable for the batch's bucket: warm-up's, the
        executable cache's, or compiled now. Without an executable cache a new shape goes through the jit. The
        first call of each (variant, bucket) after warm-up is timed into `first_call_seconds` (it compiles or
        loads the step)."""
        bucket = bucket_of(batch)
        if (variant, bucket) in self._called:
            return self._run(variant, batch, bucket)
        t0 = time.perf_counter()
        if self.executable_cache is not None:
            self._ensure_compiled(variant, batch)
        out = self._run(variant, batch, bucket)
        self._called.add((variant, bucket))
        self.first_call_seconds += time.perf_counter() - t0
        return out

    def _run(self, variant: StepVariant, batch: StepBatch | DecodeBatch, bucket: int):
        step = self.step_of(variant)
        if isinstance(step, SplitStep):
            return step(self.params, self.kv, self.state, batch,
                        *(self._executables.get(StepKey(variant, bucket, part)) for part in SplitStep.PARTS))
        key = StepKey(variant, bucket)
        exe = self._executables.get(key)
        if exe is not None:
            try:
                return exe(self.params, self.kv, self.state, batch)
            except TypeError as e:   # the arguments' types differ from the compiled ones: checked before running
                warnings.warn(f"step {key.name}: {e}; using the jitted step")
                del self._executables[key]
        return step(self.params, self.kv, self.state, batch)

    def _ensure_compiled(self, variant: StepVariant, batch) -> None:
        parts = SplitStep.PARTS if isinstance(self.step_of(variant), SplitStep) else ("",)
        if all(StepKey(variant, bucket_of(batch), part) in self._executables for part in parts):
            return
        for key, fn, args in self._units(variant, batch):
            if key not in self._executables:
                exe = self._load(key, args)
                self._executables[key] = exe if exe is not None else self._compile_and_save(key, fn.lower(*args), args)

    def compiled(self, variant: StepVariant, batch) -> list[tuple[StepKey, Any]]:
        """The step's executables for the batch's bucket (compiled now if not yet): one, or a SplitStep's two."""
        self._ensure_compiled(variant, batch)
        return [(key, self._executables[key]) for key, _, _ in self._units(variant, batch)]

    def _units(self, variant: StepVariant, batch) -> list[tuple[StepKey, Any, tuple]]:
        """What compiles apart for a step at the batch's bucket: [(key, jitted function, arguments)], a
        SplitStep's two parts, else the step itself."""
        step, bucket = self.step_of(variant), bucket_of(batch)
        if isinstance(step, SplitStep):
            return [(StepKey(variant, bucket, part), fn, args)
                    for part, fn, args in step.parts(self.params, self.kv, self.state, batch)]
        return [(StepKey(variant, bucket), step, (self.params, self.kv, self.state, batch))]

    def _load(self, key: StepKey, args: tuple):
        cache = self.executable_cache
        return cache.load(cache.key(key.name, self._settings, args)) if cache else None

    def _compile_and_save(self, key: StepKey, lowered, args: tuple) -> Any:
        exe = lowered.compile()
        if self.executable_cache:
            self.executable_cache.save(self.executable_cache.key(key.name, self._settings, args), exe)
        return exe

    # ---- padded, inert batches: warm-up's, and the templates the engine fills in ----
    def empty_mixed(self, T: int, rows: int | None = None) -> dict[str, np.ndarray]:
        """A mixed step's host arrays for T tokens and `rows` sequences (default max_num_seqs; a one-sequence
        prompt step's batch has 1: its page table is one row). A LongRoPE model's also hold `rope_long` (StepBatch's;
        no sequence's prompt long until the caller says so)."""
        B = rows or self.max_num_seqs
        longrope = {} if self.cfg.rope_longrope is None else {"rope_long": np.zeros(B, bool)}
        return dict(
            tokens=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
            slot_mapping=np.full(T, SCRATCH_PAGE * self.page_size, np.int32), token_seq=np.zeros(T, np.int32),
            next_tokens=np.zeros(T, np.int32), from_state=np.zeros(T, bool),
            page_table=self.empty_page_table(B), query_start=np.zeros(B + 1, np.int32),
            sample_index=np.zeros(B, np.int32), emits=np.zeros(B, bool),
            state_row=np.full(B, self.scratch_row, np.int32),
            step_index=np.zeros(B, np.int32), **longrope,
        )

    def empty_verify(self, T: int, rows: int, width: int) -> dict[str, np.ndarray]:
        """A verify step's host arrays: a mixed step's for T tokens and `rows` sequences, and the verify fields
        for `width` rows scored a sequence."""
        return dict(step=self.empty_mixed(T, rows), score_rows=np.zeros((rows, width), np.int32),
                    drafts=np.zeros((rows, width - 1), np.int32), num_drafts=np.zeros(rows, np.int32))

    def empty_page_table(self, B: int) -> np.ndarray:
        return np.full((B, self.pages_per_seq), SCRATCH_PAGE, np.int32)

    def empty_decode(self, B: int, n_stop: int = 8) -> dict[str, np.ndarray]:
        return dict(
            tokens=np.zeros(B, np.int32), positions=np.zeros(B, np.int32),
            page_table=self.empty_page_table(B),
            state_row=np.full(B, self.scratch_row, np.int32), step_index=np.zeros(B, np.int32),
            remaining=np.zeros(B, np.int32), stop_ids=np.full((B, n_stop), -1, np.int32),
            active=np.zeros(B, bool),
        )

    def inert_decode(self, B: int) -> DecodeBatch:
        """A decode batch of B rows on the device that touches only the scratch page and row."""
        return to_device(DecodeBatch(**self.empty_decode(B), sampling=SamplingArrays.from_params([], [], B)))

    def bucket_calls(self) -> list[tuple[StepVariant, StepBatch | DecodeBatch]]:
        """Every step a serving engine may call, with an inert batch of each of its buckets."""
        calls = []
        for t in self.token_buckets:
            for one in (False, True):   # a "prefixed" step takes "fresh"'s one-row batch
                if one and not self.has_one_sequence_step(t):
                    continue
                rows = 1 if one else self.max_num_seqs
                batch = to_device_packed(StepBatch(**self.empty_mixed(t, rows),
                                                   sampling=SamplingArrays.from_params([], [], rows)))
                calls += [(v, batch) for v in self.steps if v.phase in ("mixed", "prompt-logprobs")
                          and v.one_sequence == one]
        for v in [v for v in self.steps if v.phase == "verify"]:
            if v.attention == "paged":
                shapes = [(t, self.max_num_seqs) for t in self.token_buckets]
            else:
                shapes = [(b * v.steps, b) for b in self.batch_buckets]
            for T, rows in shapes:
                a = self.empty_verify(T, rows, v.steps)
                step = StepBatch(**a.pop("step"), sampling=SamplingArrays.from_params([], [], rows))
                calls.append((v, to_device_packed(VerifyBatch(step=step, **a))))
        for b in self.batch_buckets:
            batch = self.inert_decode(b)
            n = self.decode_steps_for(b)
            calls += [(v, batch) for v in self.steps if v.phase == "decode" and v.steps == n
                      and (v.sampler != "filter-p" or filter_pays(b, "filter-p"))]   # choose_sampler sorts there
        return calls

    def warmup(self, progress: bool = True, threads: int = 1, compile: bool = True) -> float:
        """Start the scratch row's sampler state; with `compile`, compile every bucket now and run each once
        (inert batches touch only the scratch page). Returns seconds.

        A step found in the executable cache is loaded (no tracing, no lowering); the others are traced and
        lowered one by one on this thread and compiled on `threads` threads side by side (XLA compiles
        outside the GIL), then saved. Where the time went is left in `warmup_breakdown` (seconds): `load`,
        `lower` (summed), `compile` (summed over the threads), `compile_wall` (the parallel phase, lowering
        included) and `first_runs`."""
        t0 = time.perf_counter()
        self.start_sequence(self.scratch_row, [0], [])
        if not compile:   # the decode batches' host-to-device copies (one small program each) at least
            for b in self.batch_buckets:
                self.inert_decode(b)
            return time.perf_counter() - t0
        calls = self.bucket_calls()
        units = [unit for variant, batch in calls for unit in self._units(variant, batch)]
        spent = dict(load=0.0, lower=0.0, compile=0.0, compile_wall=0.0, first_runs=0.0)
        bar = tqdm(total=len(units), desc="compiling steps", unit="step", disable=not progress, leave=False)

        def timed_compile(key, lowered, args):
            t = time.perf_counter()
            self._executables[key] = self._compile_and_save(key, lowered, args)
            return time.perf_counter() - t

        with ThreadPoolExecutor(max(1, threads)) as pool:
            t1 = time.perf_counter()
            loaded = list(pool.map(lambda u: self._load(u[0], u[2]), units))
            for (key, _, _), exe in zip(units, loaded):
                if exe is not None:
                    self._executables[key] = exe
            spent["load"] = time.perf_counter() - t1
            bar.update(sum(exe is not None for exe in loaded))
            t1 = time.perf_counter()
            futures = []
            for (key, fn, args), exe in zip(units, loaded):
                if exe is None:
                    t = time.perf_counter()
                    lowered = fn.lower(*args)
                    spent["lower"] += time.perf_counter() - t
                    futures.append(pool.submit(timed_compile, key, lowered, args))
            for f in as_completed(futures):
                try:
                    spent["compile"] += f.result()
                except Exception as e:  # the first run below compiles it again
                    warnings.warn(f"parallel compilation of a step failed ({type(e).__name__}: {e}); "
                                  "compiling it on the main thread")
                bar.update()
            spent["compile_wall"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        with self._out_of_memory_explained():
            for variant, batch in calls:
                self.kv, self.state, *out = self._call(variant, batch)
                jax.block_until_ready(out)
        spent["first_runs"] = time.perf_counter() - t1
        self.first_call_seconds = 0.0
        bar.close()
        self.warmup_breakdown = spent
        return time.perf_counter() - t0
