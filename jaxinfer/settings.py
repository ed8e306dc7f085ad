"""The engine's settings, declared once: `EngineConfig` (what a user sets; the command line is made from
its fields and their help) and `Tuning` (measured switches of the GPU fast path that a user should not
need; docs/tuning.md gives each one's measurement).

A field's help is its `help` metadata; `choices` lists the values a string field takes. A field whose
default is None is resolved for the machine (`EngineConfig.resolved`): the default it gets is in its help.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

CACHE_DIR = os.path.expanduser("~/.cache/jaxinfer")
MAX_SPECULATIVE_TOKENS = 15   # a verify step scores at most 16 rows of a sequence


def setting(default: Any = None, help: str = "", choices: tuple[str, ...] | None = None,
            default_factory: Any = None, flag: bool = True) -> Any:
    """A settings field: its help text, the values a string takes, and whether the command line has it."""
    meta = {"help": help, "choices": choices, "flag": flag}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Switches of the engine's GPU fast path, each measured on the H200 (docs/tuning.md). None: the
    measured default for the backend (`resolved`). Set them for A/B runs: `Engine(..., overlap_mixed=False)`,
    `jaxinfer serve --tuning overlap_mixed=false`."""

    unroll_layers: bool | None = setting(help="layers as straight-line code over per-layer weights (GPU: on)")
    greedy_mixed_step: bool | None = setting(
        help="a greedy-only prompt step, no sampling branch whose predicate the runtime reads back (GPU: on)")
    overlap_decode: bool = setting(True, help="read decode dispatches back one dispatch late")
    chain_verify: bool = setting(
        True, help="launch a speculative verify step before the previous one is read back, as if it accepted "
                   "every draft (n-gram; rows whose guess failed are dropped)")
    overlap_mixed: bool | None = setting(help="read prompt steps back one step late (GPU: on)")
    prefill_behind_decode: bool | None = setting(
        help="launch a newcomer's prompt step behind the decode dispatch in flight (GPU: on)")
    fresh_prompt_attention: bool | None = setting(
        help="a one-prompt step from position 0 of >= fresh_prompt_min_tokens runs flash attention (GPU: on)")
    fresh_prompt_min_tokens: int = setting(1024, help="the smallest such step")
    prefixed_chunk_attention: bool | None = setting(
        help="a chunk after a cached prefix runs two flash attentions merged by log-sum-exp (GPU: on)")
    prompt_step_head_layers: int | None = setting(
        help="a one-prompt step as two executables, this many layers in the first (GPU: 6; 0: one)")
    plain_sampling_step: bool | None = setting(
        help="the host picks a sampling variant without sort or device-side branch where it can (GPU: on)")
    short_decode_max_batch: int = setting(0, help="batches up to this size run short dispatches (0: off)")
    short_decode_steps: int = setting(2, help="decode steps per dispatch of those batches")
    chain_early_ms: float = setting(1.0, help="a server launches the next decode dispatch this early")
    token_buckets: tuple[int, ...] | None = setting(
        help="prompt-step sizes to compile (default: powers of two up to the step budget)")
    compile_threads: int | None = setting(help="steps compiled side by side (GPU: half the cores, at most 8)")
    executable_cache: bool | None = setting(
        help="keep compiled steps whole in cache_dir/executables (GPU: on; XLA:CPU executables loaded back can miss "
        "their kernels)")
    num_pages: int | None = setting(help="KV pages (default: from the device memory left after the weights)")

    def resolved(self, gpu: bool) -> Tuning:
        defaults = dict(unroll_layers=gpu, greedy_mixed_step=gpu, overlap_mixed=gpu, prefill_behind_decode=gpu,
                        fresh_prompt_attention=gpu, prefixed_chunk_attention=gpu, plain_sampling_step=gpu,
                        prompt_step_head_layers=6 if gpu else 0, executable_cache=gpu,
                        compile_threads=min(8, (os.cpu_count() or 2) // 2) if gpu else 1)
        return dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def validate(self) -> None:
        for name in ("fresh_prompt_min_tokens", "short_decode_steps"):
            _at_least(name, getattr(self, name), 1)
        for name in ("short_decode_max_batch", "chain_early_ms", "prompt_step_head_layers"):
            _at_least(name, getattr(self, name), 0)
        _at_least("compile_threads", self.compile_threads, 1)
        _at_least("num_pages", self.num_pages, 2)
        if self.token_buckets is not None and min(self.token_buckets, default=0) < 1:
            raise ValueError(f"token_buckets must be positive, got {self.token_buckets}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What a user sets; one default each. `jaxinfer generate|chat|serve|bench` take every field as a flag
    (`--max-num-seqs`, ...) and `LLM(model, **fields)` / `Engine(model, **fields)` as keywords; a Tuning
    field's name is taken there too and goes to `tuning`."""

    dtype: str = setting("auto", "parameter and compute dtype: auto is the checkpoint's own (config.json)",
                         ("auto", "float32", "bfloat16", "float16"))
    ops: str = setting("auto", "op backend: auto is the Pallas kernels on a GPU, the jax.numpy reference elsewhere",
                       ("auto", "pallas", "reference", "pallas-interpret"))
    max_model_len: int | None = setting(None, "context window in tokens (default: the model's)")
    max_num_seqs: int = setting(256, "sequences in the running batch")
    max_num_batched_tokens: int | None = setting(
        None, "token budget of a prompt step; longer prompts run in chunks (default: 2048 on GPUs, 512 elsewhere)")
    page_size: int = setting(16, "tokens per KV cache page")
    kv_cache_dtype: str = setting("auto", "KV cache storage: auto is the model's dtype; fp8 (e4m3) halves it; int8 "
                                  "(a scale per cached vector) about halves it", ("auto", "fp8", "fp8_e4m3", "int8"))
    quantization: str | None = setting(
        None, "weights quantized at load: int8 (weight-only, one scale per output channel) or fp8 (e4m3); a "
        "pre-quantized checkpoint is read as published", ("int8", "fp8"))
    speculative: str | None = setting(
        None, "speculative decoding: ngram (prompt lookup), draft:DIR (a smaller model of the same tokenizer) or "
        "dflash:DIR (a DFlash block drafter)")
    num_speculative_tokens: int | None = setting(
        None, "the most tokens drafted a step (default: 4; a DFlash drafter's block size less one)")
    gpu_memory_fraction: float = setting(0.9, "share of device memory for weights and KV cache")
    tensor_parallel_size: int = setting(
        1, "devices one model is split over (tensor parallelism: heads, MLP width and vocabulary sharded; "
        "docs/tensor_parallel.md)")
    distributed: str | None = setting(
        None, "join a run over several hosts, one process each: HOST:PORT,NUM_PROCESSES,PROCESS_ID (process 0 at "
        "HOST:PORT coordinates; jax.distributed; docs/tensor_parallel.md)")
    decode_steps: int = setting(8, "decode steps per device dispatch; fewer let a new request start sooner")
    max_logprobs: int = setting(20, "the most top logprobs a request may ask for")
    enable_prefix_caching: bool = setting(True, "reuse the KV pages of prompts' shared prefixes")
    enable_prompt_logprobs: bool = setting(False, "also compile the steps that score prompt tokens (echo)")
    seed: int | None = setting(None, "seeds the requests that bring no seed (default: random)")
    generation_config: str = setting(
        "auto", "sampling defaults for what a request leaves out: auto (the model's generation_config.json), "
        "none (temperature 1, no filters), or a folder holding one")
    compile_all_at_start: bool = setting(
        False, "compile every step shape at start-up (serve and bench do: no request then waits on a compile); "
        "otherwise each compiles on first use", flag=False)
    cache_dir: str = setting(CACHE_DIR, "compiled steps kept here across runs ('' turns the caches off)")
    skip_tokenizer_init: bool = setting(False, "token ids in and out only (no tokenizer.json needed)", flag=False)
    progress: bool | None = setting(None, "progress bars (default: when stderr is a terminal)")
    tuning: Tuning = setting(help="measured GPU switches (docs/tuning.md)", default_factory=Tuning, flag=False)

    @classmethod
    def from_options(cls, config: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """`config` (default: the defaults) with `options` set: EngineConfig fields, or Tuning fields (which
        go to `tuning`). An unknown name is an error that names it."""
        config = config or cls()
        engine_names = {f.name for f in dataclasses.fields(cls)}
        tuning_names = {f.name for f in dataclasses.fields(Tuning)}
        unknown = sorted(set(options) - engine_names - tuning_names)
        if unknown:
            raise ValueError(f"unknown engine setting{'s' * (len(unknown) > 1)}: {', '.join(unknown)}")
        tuning = {k: v for k, v in options.items() if k in tuning_names}
        if "tuning" in options:
            config = dataclasses.replace(config, tuning=options["tuning"])
        if tuning:
            config = dataclasses.replace(config, tuning=dataclasses.replace(config.tuning, **tuning))
        return dataclasses.replace(config, **{k: v for k, v in options.items() if k in engine_names - {"tuning"}})

    def resolved(self, backend: str, is_terminal: bool) -> EngineConfig:
        """The machine's defaults filled in where a field is None (ops, dtype and max_model_len are resolved
        by the engine, which knows the model)."""
        gpu = backend == "gpu"
        return dataclasses.replace(
            self, tuning=self.tuning.resolved(gpu),
            max_num_batched_tokens=(2048 if gpu else 512) if self.max_num_batched_tokens is None
            else self.max_num_batched_tokens,
            progress=is_terminal if self.progress is None else self.progress)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}")
        for name in ("max_num_seqs", "page_size", "decode_steps", "tensor_parallel_size"):
            _at_least(name, getattr(self, name), 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _at_least("max_model_len", self.max_model_len, 2)
        _at_least("max_logprobs", self.max_logprobs, 0)
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got "
                             f"{self.num_speculative_tokens}")
        if self.speculative is not None and not (self.speculative == "ngram" or
                                                 self.speculative.startswith(("draft:", "dflash:"))):
            raise ValueError(f"speculative must be ngram, draft:DIR or dflash:DIR, got {self.speculative!r}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        t = self.tuning
        t.validate()
        if t.short_decode_max_batch and t.short_decode_steps > self.decode_steps:
            raise ValueError(f"short_decode_steps ({t.short_decode_steps}) must be at most decode_steps "
                             f"({self.decode_steps})")


def _at_least(name: str, value: int | float | None, low: int) -> None:
    if value is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """`jaxinfer serve`'s own settings (the engine's are EngineConfig's)."""

    host: str = setting("127.0.0.1", "address to bind (loopback only unless told otherwise)")
    port: int = setting(8000, "port to bind")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on all but /health "
                                  "(default: $JAXINFER_API_KEY)")
    served_model_name: str | None = setting(None, "the model's name in the API (default: its folder's name)")
    chat_template: str | None = setting(None, "a Jinja chat template file, for a model that has none (without one "
                                        "such a model answers chat completions with 400)")
    max_waiting: int = setting(256, "requests that may wait for a slot; beyond that, 503 at once")
    log_level: str = setting("info", "uvicorn's log level", ("critical", "error", "warning", "info", "debug"))
    freeze_gc: bool = setting(True, "freeze start-up's objects out of the garbage collector's scans")

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        _at_least("max_waiting", self.max_waiting, 0)
