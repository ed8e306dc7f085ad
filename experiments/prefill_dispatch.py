"""Where a prefill's time to first token goes: host preparation, launch, device, read-back; with
XLA flag variants, each in its own process.

    PYTHONPATH=. python3 bench/prefill_dispatch.py [--shape qwen3-4b] [--prompt 1024] [--out DIR]

For each variant (XLA_FLAGS) a child process loads the model (Pallas ops, the engine's GPU
defaults) with a one-prompt token bucket and reports, best of 5 single-token requests:
- ttft: add_request to the first token back on the host (what bench/prefill.py reports);
- host: add_request until the mixed step is called (scheduling, batch arrays);
- launch: the jitted step's call until it returns (device_put of the batch, argument handling,
  enqueueing the work; the device may already run);
- wait: from there until the sampled token is on the host;
- raw: device time per prefill step of back-to-back calls of the same step (no read-back between).
Optionally a profiler trace of three raw steps (kernel time against span, the idle between kernels and the memsets
before them), or of one request on the host (`host-trace`: the runtime's scopes by total time). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.table import print_table
from bench.variant_runs import (EVERY_COMMAND_TYPE, NO_COMMAND_BUFFERS, PDL, PDL_LAUNCH, SLICE_FUSION,
                                add_variant_args, apply_bench_options, run_variants)

# kernels_skinny_gemm.py --prefill --sweep's JSON, for the prefill-table variants
# kernels_hopper_gemm.py's JSON, for the hopper-fastest variants: $HOPPER_JSON, else this call's $OUT
HOPPER_JSON = os.environ.get("HOPPER_JSON") or os.path.join(os.environ.get("OUT", "."), "kernels_hopper_gemm.json")
PROFILED = "--xla_enable_command_buffers_during_profiling=true"   # a profiled step keeps its command buffers
VARIANTS = {  # name: (XLA_FLAGS, profile (False, True: the device, "host"), engine options)
    "default": ("", False, {}),
    # prompt rows on XLA's GEMM (+ the SwiGLU multiply in XLA) where the Mosaic GPU GEMM's table takes them
    "no-hopper": ("", False, {"no_hopper_gemm": True}),
    # the Mosaic GEMM's table rows at the configs that ran fastest in kernels_hopper_gemm.py (its JSON in $OUT)
    "hopper-fastest": ("", False, {"hopper_table": HOPPER_JSON}),
    "profiled-hopper-fastest": (PROFILED, True, {"hopper_table": HOPPER_JSON}),
    "no-cmdbuf": (NO_COMMAND_BUFFERS, False, {}),
    # the step puts its outputs in pinned host memory itself (EngineConfig.mixed_outputs_on_host): reading the
    # first token back then needs no copy dispatched after the step ends (traced: the device-to-host copies
    # started ~0.5-0.9 ms after the step's last kernel; round 23)
    "host-outputs": ("", False, {"mixed_outputs_on_host": True}),
    "host-trace-host-outputs": (PROFILED, "host", {"mixed_outputs_on_host": True}),
    # the prompt step as two executables, its first N layers apart (EngineConfig.prompt_step_head_layers): the
    # device starts on a small graph while the host launches the big one (round 23)
    "split-3": ("", False, {"prompt_step_head_layers": 3}),
    "split-6": ("", False, {"prompt_step_head_layers": 6}),
    "split-12": ("", False, {"prompt_step_head_layers": 12}),
    "host-trace-split-6": (PROFILED, "host", {"prompt_step_head_layers": 6}),
    # the step's CUDA graph cut at every FFI custom call (the Mosaic GPU GEMMs and flash attention run outside
    # it): ~110 small graphs and ~110 kernel launches instead of one graph of ~340 kernels, so the device could
    # start after the first small graph while the host launches the rest (round 23)
    "cmdbuf-no-custom": ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN", False, {}),
    "profiled-with-cmdbuf": (PROFILED, True, {}),
    "profiled-no-hopper": (PROFILED, True, {"no_hopper_gemm": True}),
    # what the ~1.3 ms launch is: one request traced on the host side too (the runtime's scopes by total time)
    "host-trace": (PROFILED, "host", {}),
    # the memsets before gate/up's and o_proj's GEMM and cuDNN's attention (3 a layer, each followed by ~5 us
    # idle; round 14): with XLA's concurrent scheduling in the command buffers, a memset that does
    # not depend on the kernel before it may run beside it; cuBLASLt on and off (another GEMM path and
    # algorithms); and the launch (cuGraphLaunch took most of it): fixed addresses for stable buffers
    "profiled-concurrent": (f"{PROFILED} --xla_gpu_command_buffer_scheduling_mode=CONCURRENT", True, {}),
    "profiled-cublaslt-on": (f"{PROFILED} --xla_gpu_enable_cublaslt=true", True, {}),
    "profiled-cublaslt-off": (f"{PROFILED} --xla_gpu_enable_cublaslt=false", True, {}),
    "profiled-skip-profiled": (f"{PROFILED} --xla_gpu_command_buffer_update_mode=SKIP_PROFILED", True, {}),
    # the memsets are 4 bytes each, inside cuBLAS's gate/up GEMM and cuDNN's attention (a library's own counter);
    # XLA's autotuner picks each GEMM's algorithm by its time alone. Level 0: cuBLAS's heuristic choice instead
    "profiled-autotune-0": (f"{PROFILED} --xla_gpu_autotune_level=0", True, {}),
    # GEMM algorithms that reduce across tiles with atomics need a zeroed counter; deterministic ones may not
    "profiled-deterministic": (f"{PROFILED} --xla_gpu_exclude_nondeterministic_ops=true", True, {}),
    # is part of the step outside XLA's command buffers? Every command type in them, and command buffers of
    # any size (H200, round 13: neither helped; the raw step idles 0.4 ms between ~450 kernels)
    # the norm/RoPE/cache-write kernel with a program's tokens as tiles of 8 (the default since the eighteenth
    # round), 16 or 32 (rope_kv_write.TILED; the token loop it replaced is gone since the nineteenth)
    # the Pallas GEMM where kernels_skinny_gemm.py --prefill --sweep (its JSON in $OUT) swept a product: gate/up with
    # its SwiGLU epilogue takes the SiLU-multiply kernel (15 us a layer at 1k) and cuBLAS's memset gap out
    "rope-tiled": ("", False, {"rope_write_tiled": 8}),
    "rope-tiled-16": ("", False, {"rope_write_tiled": 16}),
    "rope-tiled-32": ("", False, {"rope_write_tiled": 32}),
    "profiled-rope-tiled": (PROFILED, True, {"rope_write_tiled": 8}),
    "cmdbuf-every-type": (EVERY_COMMAND_TYPE, False, {}),
    "graph-min-1": ("--xla_gpu_graph_min_graph_size=1", False, {}),
    # launch ~1.1 ms for one call: is it XLA updating the command buffers' recorded addresses? SKIP_TEMP gives
    # the temporaries fixed virtual addresses (the VMM allocator), so only commands on parameters/outputs update
    "update-skip-temp": ("--xla_gpu_command_buffer_update_mode=SKIP_TEMP", False, {}),
    # the step takes every layer's weights as separate arrays (~300); a call's host time grows with them
    # (bench/dispatch_args.py). The layers unrolled over the stacked [L, ...] arrays instead (a dozen): XLA's
    # GEMMs then read slices of the stacks, copied out first unless XLA fuses the slice into the GEMM
    "stacked-weights": ("", False, {"weights": "stacked", "unroll_layers": True}),
    "stacked-weights-dsf": (SLICE_FUSION, False, {"weights": "stacked", "unroll_layers": True}),
    # model.split_layers as it was before the vectors stayed stacked (292 arrays a step for Qwen3-4B, not 148)
    "split-every-array": ("", False, {"weights": "split-every-array", "unroll_layers": True}),
    # the batch split by a call of its own and handed to the step as ~20 arrays (before 2026-11-30)
    "unpacked-batch": ("", False, {"unpacked_batch": True}),
    # the layers as a rolled scan over the stacked arrays (the CPU default): a dozen arrays and one compiled
    # layer; XLA's dynamic slice fusion is made for a scan's per-layer slices feeding GEMMs (no copy), and
    # with WHILE in the command buffers the loop stays inside one CUDA graph
    "rolled": ("", False, {"unroll_layers": False}),
    "rolled-dsf-while": (f"{SLICE_FUSION} {EVERY_COMMAND_TYPE}", False, {"unroll_layers": False}),
    # XLA may put any GEMM into a Triton fusion, with the elementwise work around it (norms, SiLU,
    # residual adds) fused in, where its autotuner finds that faster than cuBLAS + separate kernels
    "triton-gemm-any": ("--xla_gpu_triton_gemm_any=true", False, {}),
    # the prompt's attention on its own rows by cuDNN's flash attention (EngineConfig.fresh_prompt_attention;
    # the GPU default since round 9), and without it (the paged kernel)
    "fresh-attention": ("", False, {"fresh_prompt_attention": True, "greedy_mixed_step": True}),
    "paged-attention": ("", False, {"fresh_prompt_attention": False}),
    # the fresh prompt's attention: the Mosaic GPU flash kernel (pallas/hopper_attention.py; the default at 1k-2k
    # since round 22) at other configs, or cuDNN's flash attention (31.5 us a layer at 1k and ~6 us
    # of idle before it for its memset; round 21)
    "cudnn-attention": ("", False, {"flash_table": []}),
    "hopper-flash": ("", False, {"flash_table": [[1024, 32768, {"stages": 2}]]}),
    "hopper-flash-2q": ("", False, {"flash_table": [[1024, 2048, {"stages": 1, "q_buffers": 2}]]}),
    "profiled-hopper-flash": (PROFILED, True, {"flash_table": [[1024, 32768, {"stages": 2}]]}),
    # programmatic dependent launch (variant_runs.PDL): the step's ~450 kernels each wait for the one before
    "pdl": (PDL, False, {}),
    "pdl-launch": (PDL_LAUNCH, False, {}),
    "profiled-pdl-launch": (f"{PROFILED} {PDL_LAUNCH}", True, {}),
}


def child(model_dir: str, ops: str, T: int, profile: bool | str, options: dict) -> dict:
    """One variant's figures; profile True: a device trace of 3 raw steps, "host": one request traced on the host."""
    import jax
    import numpy as np

    from jaxinfer.engine.engine import Engine
    from jaxinfer.sampling import SamplingParams

    options = apply_bench_options(options)
    t0 = time.perf_counter()
    engine = Engine(model_dir, dtype="bfloat16", ops=ops, max_num_seqs=1, max_model_len=T + 16,
                    max_num_batched_tokens=T, token_buckets=[T], progress=False, skip_tokenizer_init=True,
                    max_logprobs=0, enable_prefix_caching=False, num_pages=-(-(T + 16) // 16) + 1, **options)
    res = dict(start_s=time.perf_counter() - t0, compile_s=engine.compile_seconds)
    r = engine.runner
    marks: dict = {}
    launch_mixed, fetch = r.launch_mixed, r.fetch

    def timed_launch_mixed(batch, *args, **kw):
        marks["call"] = time.perf_counter()
        marks["batch"] = batch
        return launch_mixed(batch, *args, **kw)

    def timed_fetch(arrays):
        marks.setdefault("launched", time.perf_counter())
        return fetch(arrays)

    r.launch_mixed, r.fetch = timed_launch_mixed, timed_fetch
    prompt = np.random.default_rng(0).integers(100, 1000, T).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows = []
    for _ in range(6):   # the first is a warm-up
        marks.clear()
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        first = engine.take_finished(rid).outputs[0].token_ids
        t1 = time.perf_counter()
        rows.append((t1 - t0, marks["call"] - t0, marks["launched"] - marks["call"], t1 - marks["launched"]))
    best = min(rows[1:])
    res["first_token"] = int(first[0])   # variants that change only how kernels launch must agree on it
    res.update({k: 1e3 * v for k, v in zip(("ttft_ms", "host_ms", "launch_ms", "wait_ms"), best)})
    r.launch_mixed, r.fetch = launch_mixed, fetch

    batch = jax.device_put(marks["batch"])

    # as the engine runs this greedy prompt
    name = next(n for n in ("mixed-greedy-fresh", "mixed-greedy", "mixed") if n in r.steps)

    def raw(n):
        out = None
        for _ in range(n):
            r.kv, r.state, *out = r._call(name, batch)
        jax.block_until_ready(out)

    raw(2)
    n = 10
    t0 = time.perf_counter()
    raw(n)
    res["raw_ms"] = 1e3 * (time.perf_counter() - t0) / n

    def call_returns(n, keep):
        """ms between the returns of n back-to-back calls, and the wait for the last: if the host ran ahead of
        the device, the calls return within a launch's time of each other and the wait holds the rest;
        keep: every call's outputs stay alive (no output buffer is reused)"""
        kept, out, t = [], None, [time.perf_counter()]
        for _ in range(n):
            r.kv, r.state, *out = r._call(name, batch)
            t.append(time.perf_counter())
            if keep:
                kept.append(out)
        jax.block_until_ready(out)
        t.append(time.perf_counter())
        return [round(1e3 * (b - a), 3) for a, b in zip(t, t[1:])]

    res["raw_call_returns_ms"] = call_returns(6, keep=False)
    res["raw_call_returns_kept_ms"] = call_returns(6, keep=True)
    if profile == "host":
        from bench.trace_kernels import (kernel_trace, print_host_summary, print_request_timeline, request_timeline,
                                         summarize_host)

        with kernel_trace("/tmp/trace-prefill-host"):
            rid = engine.add_request(prompt, params)
            while engine.has_unfinished():
                engine.step()
            engine.take_finished(rid)
        res["host_trace"] = summarize_host("/tmp/trace-prefill-host")
        print_host_summary(res["host_trace"])
        res["timeline"] = request_timeline("/tmp/trace-prefill-host")
        print_request_timeline(res["timeline"])
    elif profile:
        from bench.trace_kernels import kernel_trace, print_summary, summarize

        t0 = time.perf_counter()
        raw(3)
        res["raw3_wall_ms"] = 1e3 * (time.perf_counter() - t0) / 3
        with kernel_trace("/tmp/trace-prefill-dispatch"):
            t0 = time.perf_counter()
            raw(3)
            res["traced_raw3_wall_ms"] = 1e3 * (time.perf_counter() - t0) / 3   # against the trace's span a step
        s = summarize("/tmp/trace-prefill-dispatch", steps=3)
        print_summary(s)
        res.update({k: s.get(k) for k in ("kernels_per_step", "kernel_us_per_step", "busy_us_per_step",
                                           "span_us_per_step", "copies_per_step", "short_gaps_us_per_step",
                                           "gaps_over", "gap_pairs", "memsets_per_step", "memset_us_per_step",
                                           "memsets_before")})
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    add_variant_args(ap, VARIANTS)
    ap.add_argument("--prompt", type=int, default=1024)
    args = ap.parse_args()
    model_dir = str(Path(args.models) / args.shape)
    if args.child:
        _, profile, options = VARIANTS[args.child]
        print("RESULT " + json.dumps(child(model_dir, args.ops, args.prompt, profile, options)), flush=True)
        return
    from bench.random_model import bench_model

    bench_model(args.models, args.shape)
    rows = run_variants(__file__, {name: VARIANTS[name][0] for name in args.variants},
                        ["--shape", args.shape, "--prompt", str(args.prompt), "--ops", args.ops,
                         "--models", args.models], args.timeout)
    print(f"\n{args.shape}, prompt {args.prompt}, ops {args.ops}")
    print_table(rows, [("variant", "variant", ""), ("TTFT ms", "ttft_ms", ".2f"), ("host ms", "host_ms", ".2f"),
                       ("launch ms", "launch_ms", ".2f"), ("wait ms", "wait_ms", ".2f"),
                       ("raw step ms", "raw_ms", ".2f"), ("compile s", "compile_s", ".1f"),
                       ("first token", "first_token", "")])
    Path(args.out, "prefill_dispatch.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
