"""Batched decode and offline throughput against the roofline at each batch size; prefix-cache TTFT gain.

    PYTHONPATH=. python3 bench/throughput.py [--shape qwen3-4b] [--batches 1 8 32 64 128 256] [--context 1024]
                                             [--requests 1000] [--system 2048] [--out DIR]
                                             [--decode-only] [--attention-config SPLITS/BLOCK_K]
                                             [--quantization fp8 int8] [--tensor-parallel-size N]

1. Decode step time at each batch size B, every sequence at `--context` tokens: roofline per step =
   max(bytes / HBM read bandwidth, FLOPs / dense GEMM rate), bytes = weights once + each sequence's
   K/V, FLOPs = 2 * params * B (+ attention), both ceilings measured in this run. Beside the device's step, two
   end-to-end ones (the engine's whole loop): over a run of --steps tokens, whose prompts finish prefill a chunk
   apart so that most of its steps run fewer than B rows (the batch's tail), and over the --steps more steps that a
   run of twice the tokens adds, all of B rows once every prompt is done before the first sequence is (the full
   batch: prefill chunks fewer than --steps).
2. Offline throughput: `--requests` requests, prompt lengths uniform in [64, 1024], output lengths
   uniform in [16, 512] (seeded), all submitted at once; generated tokens / wall time.
3. Prefix caching: time to first token of a request whose `--system`-token system prompt is cached
   (a second request with the same prefix) against a cold one (prefix caching off).
--decode-only stops after 1; --attention-config gives every decode attention call that split config instead of
the table's (the A/B of a table row in the step, one process per config).
--quantization fp8 (int8): after the bf16 parts, 1 runs again for each format on an engine with its weights
quantized at load (EngineConfig.quantization; the same KV cache dtype, the same prompts). Its roofline counts the
bytes its loaded parameters hold (8-bit values and scales; bench/decode.py's param_step_bytes) plus the KV bytes, and
its speed-up is over bf16 at the same batch in this run. --fp8-tables JSON: the 8-bit tables a
bench/kernels/quantized_gemv.py --fp8-rows run measured (its quantized_gemv.json), patched in before the engines start.
--tensor-parallel-size N: every engine over N devices (docs/tensor_parallel.md). The roofline is the aggregate one:
each device reads 1/N of the bytes at the measured bandwidth and does 1/N of the FLOPs at the measured GEMM rate (the
rate of N devices), so the roofline step is the single-device one / N (the all-reduces cost nothing in it); the
greedy tokens' hash should equal TP 1's (bf16 may differ where a sum's order moves an argmax). 8-bit weights at TP > 1
are split as the bf16 ones (docs/tensor_parallel.md).
Random bf16 weights at real shapes (bench.random_model), loaded through our loader. Prints
tables as it goes; writes throughput.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time
from pathlib import Path

import jax
import numpy as np

from bench.ceilings import dense_gemm_rate, hbm_read_ceiling
from bench.trace_kernels import keep_command_buffers_when_profiling, trace_engine_decode
from jaxinfer.model.config import load_config
from jaxinfer.engine.engine import Engine
from bench.random_model import bench_model
from jaxinfer.sampling import SamplingParams


_FORCED: list[str] = []   # kernel-choosing functions this process patched (force_attention_config)


def tokens_fingerprint(token_ids) -> str:
    """12 hex digits of the greedy tokens (a list, or a list of equal-length lists): runs that change only how a
    kernel computes or is launched must agree on it."""
    import hashlib

    return hashlib.sha1(np.asarray(token_ids, np.int64).tobytes()).hexdigest()[:12]


def engine_for(model_dir, ops, max_num_seqs, max_model_len, **kw) -> Engine:
    """Every step compiled at start-up unless kw says otherwise: the timed runs never compile."""
    if _FORCED:   # the executable cache's key sees the kernel tables, not a patched function: compile afresh
        kw = {**kw, "executable_cache": False}
    kw = {"compile_all_at_start": True, **kw}
    return Engine(model_dir, dtype="bfloat16", ops=ops, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                  max_num_batched_tokens=2048, progress=False, skip_tokenizer_init=True, max_logprobs=0, **kw)


def run_all(engine: Engine, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0, [engine.take_finished(i) for i in ids]


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


ROW_HEADER = ("| batch | decode step ms | tok/s | share | end-to-end step ms | tok/s | share "
              "| full-batch end-to-end ms | share | roofline ms | greedy tokens |")


def decode_sweep(engine, cfg, batches, context, steps, bw, gemm, rng, profile=(), warm_all: bool = False,
                 weight_bytes: float | None = None, base: list[dict] | None = None,
                 tensor_parallel_size: int = 1) -> list[dict]:
    """warm_all: warm with every row (an engine that compiles on first use compiles each batch's steps then).
    weight_bytes: what a step reads of the weights (default: the bf16 parameters but the input embedding); base: the
    bf16 rows, for each row's speed-up (a last column). tensor_parallel_size N: the roofline of N devices (bw and gemm
    are one device's), each reading 1/N of the bytes and doing 1/N of the FLOPs."""
    rows = []
    for B in batches:
        prompts = [rng.integers(100, cfg.vocab_size - 100, context).tolist() for _ in range(B)]
        params = [SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)] * B
        if warm_all:   # the runs below once each, so that each compiles what it takes first
            for n in (1, steps, 2 * steps):
                run_all(engine, prompts, [dataclasses.replace(p, max_tokens=n) for p in params])
        else:
            run_all(engine, prompts[:1], params[:1])                 # warm
        # Decode time per step = (wall with `steps` tokens - wall with 1 token) / (steps - 1): the
        # prefill and the start cancel out, and so do dispatches that run past the last token.
        # (The engine has prefix caching off: both runs send the same prompts.)
        prefill_only, _ = run_all(engine, prompts, [dataclasses.replace(p, max_tokens=1) for p in params])
        full, outs = run_all(engine, prompts, params)
        tokens_sha = tokens_fingerprint([o.outputs[0].token_ids for o in outs])
        step_ms = 1e3 * (full - prefill_only) / (steps - 1)
        # The prompts finish prefill a chunk apart, so most of those steps run fewer than B rows (the batch's tail).
        # A run of twice the tokens adds `steps` steps of all B rows where every sequence is done with its prompt
        # before the first is done decoding: the batch's own end-to-end step.
        double, _ = run_all(engine, prompts, [dataclasses.replace(p, max_tokens=2 * steps) for p in params])
        full_batch_ms = 1e3 * (double - full) / steps
        # a mixture of experts reads the experts that B tokens' top-k choices are expected to touch (uniform routing,
        # as random weights route) and multiplies each token by its top-k
        touched = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** B) if cfg.num_experts \
            else None
        weights = weight_bytes or 2 * (cfg.active_params(touched) - cfg.vocab_size * cfg.hidden_size *
                                       (0 if cfg.tie_embeddings else 1))
        kv = 2 * np.dtype(engine.kv_dtype).itemsize * cfg.num_layers * (context + steps / 2) * cfg.kv_size * B
        flops = 2 * cfg.active_params() * B + 4 * cfg.num_layers * cfg.q_size * (context + steps / 2) * B
        roof_ms = 1e3 * max((weights + kv) / bw, flops / gemm) / tensor_parallel_size
        raw_ms = raw_decode_step_ms(engine, B, context)
        row = dict(batch=B, step_ms=step_ms, tok_s=1e3 * B / step_ms, roofline_ms=roof_ms,
                   share=roof_ms / step_ms, decode_step_ms=raw_ms, decode_share=roof_ms / raw_ms, tokens_sha=tokens_sha,
                   full_batch_step_ms=full_batch_ms,
                   full_batch_share=roof_ms / full_batch_ms if full_batch_ms > 0 else None,   # (noise at tiny sizes)
                   weight_bytes=weights, kv_bytes=kv, tensor_parallel_size=tensor_parallel_size)
        same = [b for b in base or [] if b["batch"] == B]
        if same:
            row["speedup_vs_bf16"] = same[0]["decode_step_ms"] / raw_ms
        print(f"| {B} | {raw_ms:.3f} | {1e3 * B / raw_ms:,.0f} | {100 * roof_ms / raw_ms:.1f}% | {step_ms:.3f} | "
              f"{row['tok_s']:,.0f} | {100 * row['share']:.1f}% | {full_batch_ms:.3f} | "
              f"{_percent(row['full_batch_share'])} | {roof_ms:.3f} | {tokens_sha} |"
              + (f" {row['speedup_vs_bf16']:.2f} |" if same else ""), flush=True)
        if B in profile:
            row["profile"] = trace_engine_decode(engine, prompts, params, f"/tmp/trace-batch-{B}")
        rows.append(row)
    return rows


def greedy_decode_batch(engine, B: int, context: int, pages: list[int], per_seq: int):
    """A DecodeBatch (on the device) of B greedy rows at `context` tokens over `pages`, per_seq pages a row (from the
    idle engine's pool: their contents whatever they hold), for timing decode dispatches without requests."""
    import jax

    from jaxinfer.runner.batch import DecodeBatch
    from jaxinfer.sampling.sample import SamplingArrays

    r = engine.runner
    a = r.empty_decode(r.batch_bucket(B))
    for b in range(B):
        a["page_table"][b, :per_seq] = pages[b * per_seq:(b + 1) * per_seq]
    # a different token a row: rows of one token would route a mixture of experts' rows alike (a few experts read)
    lo = min(100, r.cfg.vocab_size // 4)
    a["tokens"][:B] = lo + np.arange(B) * 7919 % (r.cfg.vocab_size - 2 * lo)
    a["positions"][:B], a["remaining"][:B], a["active"][:B] = context, 10**6, True
    a["state_row"][:B] = np.arange(B)
    params = SamplingParams(temperature=0, ignore_eos=True)
    return jax.device_put(DecodeBatch(**a, sampling=SamplingArrays.from_params([params] * B, [0] * B,
                                                                               len(a["tokens"]))))


def raw_decode_step_ms(engine, B: int, context: int, dispatches: int = 4, greedy: bool = True,
                       trace_dir: str | None = None) -> float | tuple[float, dict]:
    """The device's decode step at batch B alone: back-to-back decode dispatches of B greedy rows at
    `context` tokens (pages taken from the idle engine's pool, their contents whatever they hold),
    launched from Python without reading anything back in between. greedy=False times the step
    that can sample (the runner's sort, or its branch, which reads a predicate back). With trace_dir, the dispatches are run once
    more under the profiler: returns (ms, the trace's summary)."""
    import jax

    r = engine.runner
    sampler = "greedy" if greedy else "sort" if engine.config.tuning.plain_sampling_step else "branch"
    variant = r.decode_variant(sampler, r.batch_bucket(B))
    steps = variant.steps
    per_seq = -(-(context + 2 * (dispatches + 2) * steps + 1) // engine.config.page_size)
    pages = engine.pages.allocate(B * per_seq)

    def run(batch):
        adv = batch
        for _ in range(dispatches):
            adv, outs = r.launch_decode(adv, variant)
        jax.block_until_ready(outs)

    try:
        batch = greedy_decode_batch(engine, B, context, pages, per_seq)
        jax.block_until_ready(r.launch_decode(batch, variant)[1])
        t0 = time.perf_counter()
        run(batch)
        ms = 1e3 * (time.perf_counter() - t0) / (dispatches * steps)
        if trace_dir is None:
            return ms
        from bench.trace_kernels import kernel_trace, print_summary, summarize

        with kernel_trace(trace_dir):
            run(batch)
        summary = summarize(trace_dir, steps=dispatches * steps)
        print_summary(summary)
        return ms, summary
    finally:
        engine.pages.release(pages)


def quantized_decode(model_dir, cfg, args, bw, gemm, max_len, base: list[dict]) -> dict:
    """Part 1 again for each --quantization format, on an engine with its weights quantized at load (the bf16 engine
    gone: the KV pool is sized from the memory left); rows {format: [row]}."""
    # imported here: bench.decode sets the XLA memory fraction at import, which this process's backend, up by now,
    # no longer reads
    from bench.decode import param_step_bytes

    out = {}
    for q in args.quantization:
        engine = engine_for(model_dir, args.ops, max(args.batches), max_len, enable_prefix_caching=False,
                            kv_cache_dtype=args.kv_cache_dtype, compile_all_at_start=not args.lazy_compile,
                            quantization=q, tensor_parallel_size=args.tensor_parallel_size)
        weight_bytes = param_step_bytes(engine.runner.params)
        print(f"\n## decode step at {args.context} tokens of context, {q} weights ({weight_bytes / 1e6:,.1f} MB a step, "
              f"the roofline's weight bytes), KV cache {np.dtype(engine.kv_dtype).name}; the last column: decode step "
              "x bf16's")
        print(ROW_HEADER + " x bf16 |")
        print("|---" * 12 + "|")
        out[q] = decode_sweep(engine, cfg, args.batches, args.context, args.steps, bw, gemm, np.random.default_rng(0),
                              args.profile, warm_all=args.lazy_compile, weight_bytes=weight_bytes, base=base,
                              tensor_parallel_size=args.tensor_parallel_size)
        del engine
        gc.collect()
    return out


def force_attention_config(num_splits: int, block_k: int) -> None:
    """Every decode attention call (both kernels' modules) takes SplitConfig(num_splits, block_k)."""
    from jaxinfer.pallas import decode_attention, decode_attention_rope

    def forced(*_args, **_kw):
        return decode_attention.SplitConfig(num_splits, block_k)

    decode_attention.choose_config = decode_attention_rope.choose_config = forced
    _FORCED.append(f"attention {num_splits}/{block_k}")


def patch_skinny_table(path: str, formats: list[str] = ()) -> None:
    """Add a sweep's winning rows to the skinny GEMM's tables: bench/kernels/skinny_gemm.py's JSON ("winners", bf16) to
    SKINNY_GEMM; bench/kernels/quantized_gemv.py --batched's ("winners_8bit") to SKINNY_GEMM_8BIT, those of the
    `formats` given (the 8-bit table is keyed by shape alone: give one format a run)."""
    from jaxinfer.pallas import tables

    data = json.loads(Path(path).read_text())
    rows = [(tables.SKINNY_GEMM, w) for w in data.get("winners", [])]
    rows += [(tables.SKINNY_GEMM_8BIT, w) for w in data.get("winners_8bit", []) if w["format"] in formats]
    if len({w["format"] for _, w in rows if "format" in w}) > 1:
        raise SystemExit(f"--skinny-table: 8-bit rows of {sorted(formats)} would share SKINNY_GEMM_8BIT's keys; "
                         "run one --quantization format at a time")
    for table, w in rows:
        table[(*w["shape"], w["epilogue"], w["M"])] = tables.SkinnyConfig(**w["cfg"])
        print(f"# skinny table{' (' + w['format'] + ')' if 'format' in w else ''} + {w['shape'][0]} x "
              f"{w['shape'][1]} {w['epilogue']} M={w['M']}: {w['cfg']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--ops", default="pallas")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="fp8: float8 KV pages (the roofline counts their bytes)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--profile", type=int, nargs="*", default=[], help="batch sizes whose decode to trace")
    ap.add_argument("--decode-only", action="store_true", help="only the decode step table (no offline, no prefix)")
    ap.add_argument("--attention-config", default=None, metavar="SPLITS/BLOCK_K",
                    help="every decode attention call with this split config, not the table's (A/B runs)")
    ap.add_argument("--skinny-table", default=None, metavar="JSON",
                    help="add bench/kernels/skinny_gemm.py --sweep's winning rows to the GEMM table, and "
                         "bench/kernels/quantized_gemv.py --batched's 8-bit ones of the --quantization format (A/B runs)")
    ap.add_argument("--lazy-compile", action="store_true",
                    help="compile only the steps the run takes (engine compile_all_at_start=False; A/B runs)")
    ap.add_argument("--quantization", nargs="*", default=[], choices=["int8", "fp8"],
                    help="the decode table again with weights quantized at load, for each format")
    ap.add_argument("--fp8-tables", default=None, metavar="JSON",
                    help="SKINNY_GEMM_8BIT rows and FP8_W8A8_ROWS from a quantized_gemv.py --fp8-rows run (A/B runs)")
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="every engine over this many devices; the roofline is N devices' (each reads 1/N of the "
                         "bytes and does 1/N of the FLOPs: the single-device roofline / N)")
    args = ap.parse_args()
    if args.attention_config:
        force_attention_config(*map(int, args.attention_config.split("/")))
    if args.skinny_table:
        patch_skinny_table(args.skinny_table, args.quantization)
    if args.fp8_tables:
        from bench.kernels.fp8_rows import apply_tables

        print(f"# {apply_tables(args.fp8_tables)}", flush=True)
    keep_command_buffers_when_profiling(bool(args.profile))   # before the first use of the GPU
    gpu = jax.devices()[0].platform == "gpu"
    bw = hbm_read_ceiling(4 if gpu else 0.125)
    gemm = dense_gemm_rate(8192 if gpu else 512)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; HBM read {bw / 1e12:.2f} TB/s, "
          f"bf16 GEMM {gemm / 1e12:.0f} TFLOP/s (one device); tensor parallel size {args.tensor_parallel_size}",
          flush=True)
    model_dir = bench_model(args.models, args.shape)
    cfg = load_config(model_dir, "bfloat16")
    rng = np.random.default_rng(0)
    out: dict = dict(device=jax.devices()[0].device_kind, bandwidth=bw, gemm=gemm, shape=args.shape,
                     tensor_parallel_size=args.tensor_parallel_size)

    # One engine shape for every part (the same compiled steps; the persistent compilation cache
    # serves the second engine, which differs only in prefix caching).
    max_len = max(args.context + 2 * args.steps + 32, 1024 + 512 + 16, args.system + 256)
    t0 = time.perf_counter()
    engine = engine_for(model_dir, args.ops, max(args.batches), max_len, enable_prefix_caching=False,
                        kv_cache_dtype=args.kv_cache_dtype, compile_all_at_start=not args.lazy_compile,
                        tensor_parallel_size=args.tensor_parallel_size)
    out["start_s"] = dict(total=time.perf_counter() - t0, compile=engine.compile_seconds)
    print(f"# engine start {out['start_s']['total']:.1f} s (compile {engine.compile_seconds:.1f} s)", flush=True)

    print(f"\n## decode step at {args.context} tokens of context: the device alone (back-to-back dispatches), "
          "then end to end ((wall(n tokens) - wall(1 token)) / (n - 1), decodes riding in prefill steps included, and "
          "the batch's tail of fewer rows), then the full batch end to end ((wall(2n) - wall(n)) / n)")
    print(ROW_HEADER)
    print("|---" * 11 + "|")
    out["decode"] = decode_sweep(engine, cfg, args.batches, args.context, args.steps, bw, gemm, rng, args.profile,
                                 warm_all=args.lazy_compile, tensor_parallel_size=args.tensor_parallel_size)
    if args.decode_only:
        del engine
        gc.collect()
        out["quantized"] = quantized_decode(model_dir, cfg, args, bw, gemm, max_len, out["decode"])
        Path(args.out, "throughput.json").write_text(json.dumps(out, indent=1))
        return

    prompts = [rng.integers(100, cfg.vocab_size - 100, int(n)).tolist() for n in rng.integers(64, 1025, args.requests)]
    params = [SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True)
              for n in rng.integers(16, 513, args.requests)]
    wall, outs = run_all(engine, prompts, params)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    out["offline"] = dict(requests=args.requests, wall_s=wall, generated=generated, tok_s=generated / wall,
                          preemptions=engine.scheduler.num_preemptions)
    print(f"\n## offline: {args.requests} requests, {generated:,} tokens in {wall:.1f} s = {generated / wall:,.0f} tok/s "
          f"({engine.scheduler.num_preemptions} preemptions)", flush=True)

    system = rng.integers(100, cfg.vocab_size - 100, args.system).tolist()
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ttft = {}
    for caching in (False, True):
        if caching:
            del engine
            gc.collect()
            t0 = time.perf_counter()
            engine = engine_for(model_dir, args.ops, max(args.batches), max_len, enable_prefix_caching=True,
                                kv_cache_dtype=args.kv_cache_dtype,
                                tensor_parallel_size=args.tensor_parallel_size)
            out["start_s"]["second_engine"] = time.perf_counter() - t0
        run_all(engine, [system + [7] * 8], [one])                          # warm; fills the cache
        ttft[caching] = min(run_all(engine, [system + [int(x)] * 8], [one])[0] for x in (11, 12, 13))
    del engine
    gc.collect()
    out["prefix"] = dict(cold_ms=1e3 * ttft[False], cached_ms=1e3 * ttft[True], gain=ttft[False] / ttft[True])
    print(f"\n## prefix cache: TTFT with a {args.system}-token system prompt: cold {1e3 * ttft[False]:.1f} ms, "
          f"cached {1e3 * ttft[True]:.1f} ms ({ttft[False] / ttft[True]:.1f}x); second engine start "
          f"{out['start_s']['second_engine']:.1f} s (persistent compilation cache)", flush=True)
    out["quantized"] = quantized_decode(model_dir, cfg, args, bw, gemm, max_len, out["decode"])
    Path(args.out, "throughput.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
