"""Where a batch-1 decode step's time goes: XLA flags and code variants, each in its own process.

    PYTHONPATH=. python3 bench/decode_dispatch.py [--shape qwen3-4b] [--ctx 1024] [--steps 16] [--out DIR]

For each variant (XLA_FLAGS; greedy-only decode) a child process loads the model
(Pallas ops, unrolled layers) and reports: the engine's decode step time on a greedy request, the
device time per step of back-to-back decode dispatches launched from Python with no read-back in
between ("raw"), and optionally a profiler trace (kernel time against span). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.table import print_table
from bench.variant_runs import (EVERY_COMMAND_TYPE, LOOPS_IN_COMMAND_BUFFERS, NO_COMMAND_BUFFERS, PDL, PDL_LAUNCH,
                                SLICE_FUSION, add_variant_args, apply_bench_options, run_variants)
from bench.throughput import tokens_fingerprint
from jaxinfer.engine.dispatch_timing import POLL

VARIANTS = {  # name: (XLA_FLAGS, greedy-only decode, profile, Engine options beyond the defaults below)
    "default+cond": ("", False, False, {}),
    "default+greedy": ("", True, False, {}),
    "no-cmdbuf+cond": (NO_COMMAND_BUFFERS, False, False, {}),
    "no-cmdbuf+greedy": (NO_COMMAND_BUFFERS, True, False, {}),
    "cmdbuf-while-cond+cond": (LOOPS_IN_COMMAND_BUFFERS, False, False, {}),
    "profiled-with-cmdbuf+greedy": ("--xla_enable_command_buffers_during_profiling=true", True, True, {}),
    # what the server runs with by default: top logprobs in every step, the model's whole context
    "logprobs20+greedy": ("", True, False, dict(max_logprobs=20)),
    "len40960+greedy": ("", True, False, dict(max_model_len=40960)),
    "server-defaults+greedy": ("", True, False, dict(max_logprobs=20, max_model_len=40960, decode_steps=8)),
    "server-defaults+no-cmdbuf": (NO_COMMAND_BUFFERS, True, False,
                                  dict(max_logprobs=20, max_model_len=40960, decode_steps=8)),
    # the server's late chain moved earlier (EngineConfig.chain_early_ms): its server-loop step against the
    # user step says whether the device idles between dispatches
    "server-defaults+early1": ("", True, False, dict(max_logprobs=20, max_model_len=40960, decode_steps=8,
                                                     chain_early_ms=1.0)),
    "server-defaults+early3": ("", True, False, dict(max_logprobs=20, max_model_len=40960, decode_steps=8,
                                                     chain_early_ms=3.0)),
    # model.split_layers as it was before the vectors stayed stacked (292 arrays a dispatch for Qwen3-4B, not 148)
    "default+greedy+split-every-array": ("", True, False, dict(weights="split-every-array")),
    # the layers as a rolled scan over the stacked arrays (see prefill_dispatch's "rolled" variants)
    "default+greedy+rolled": ("", True, False, dict(unroll_layers=False)),
    "default+greedy+rolled-dsf-while": (f"{SLICE_FUSION} {EVERY_COMMAND_TYPE}", True, False, dict(unroll_layers=False)),
    "server-defaults+cmdbuf-while": (LOOPS_IN_COMMAND_BUFFERS, True, False,
                                     dict(max_logprobs=20, max_model_len=40960, decode_steps=8)),
    # programmatic dependent launch: six dependent kernels a layer each lose ~3.6 us of ramp and tail
    "pdl+greedy": (PDL, True, False, {}),
    "pdl-launch+greedy": (PDL_LAUNCH, True, False, {}),
    "pdl-launch+no-cmdbuf": (f"{PDL_LAUNCH} {NO_COMMAND_BUFFERS}", True, False, {}),
    # the decode GEMVs with 2 / 4 output rows a program (x and the norm's scale loaded once for them)
    "rows2+greedy": ("", True, False, dict(gemv_rows=2)),
    "rows4+greedy": ("", True, False, dict(gemv_rows=4)),
    "qkv-rows2+greedy": ("", True, False, dict(gemv_rows={(6144, 2560): 2})),   # Qwen3-4B's QKV only
    "qkv-rows4+greedy": ("", True, False, dict(gemv_rows={(6144, 2560): 4})),
    # Llama-3-8B's QKV at 2 rows (its kernel: 15.73 -> 14.81 us, round 15), Qwen3-4B's entry kept
    # decode attention's split count at a 1,024-token context: the table gives batch 1 64 splits of 64 whenever the
    # page table spans more than 1,024 tokens (so 48 of 64 programs are empty at 1k and the merge reads 64 splits)
    "attn-16x64+greedy": ("", True, False, dict(attention_config=(16, 64))),
    "attn-64x64+greedy": ("", True, False, dict(attention_config=(64, 64))),
    "llama-qkv-rows2+greedy": ("", True, False, dict(gemv_rows={(6144, 2560): 2, (6144, 4096): 2})),
    # Qwen3-4B's o_proj (98 registers, 16 blocks an SM, 1.21 waves under ncu: round 19) at another block_in
    # or at 2 rows a program (1,280 programs: one wave), QKV's 2 rows kept
    "oproj-in128+greedy": ("", True, False, dict(gemv_block_in={(2560, 4096): 128})),   # the default since s20
    "oproj-in256+greedy": ("", True, False, dict(gemv_block_in={(2560, 4096): 256})),   # the default before
    "oproj-in512+greedy": ("", True, False, dict(gemv_block_in={(2560, 4096): 512})),
    "oproj-rows2+greedy": ("", True, False, dict(gemv_rows={(6144, 2560): 2, (2560, 4096): 2})),
    "profiled-rows2+greedy": ("--xla_enable_command_buffers_during_profiling=true", True, True, dict(gemv_rows=2)),
    "profiled-pdl-launch+greedy": (f"{PDL_LAUNCH} --xla_enable_command_buffers_during_profiling=true", True, True, {}),
}


def child(model_dir: str, ops: str, ctx: int, steps: int, greedy: bool, profile: bool, options: dict) -> dict:
    import numpy as np

    from jaxinfer.engine.engine import Engine
    from jaxinfer.sampling import SamplingParams

    dispatches, new = 8, 128
    steps = options.get("decode_steps", steps)
    max_len = max(ctx + 2 * (dispatches + 4) * steps + new + 16, options.get("max_model_len", 0))
    t0 = time.perf_counter()
    kw = {"max_logprobs": 0, "unroll_layers": True, **apply_bench_options(options), "max_model_len": max_len,
          "decode_steps": steps}
    engine = Engine(model_dir, dtype="bfloat16", ops=ops, max_num_seqs=1,
                    max_num_batched_tokens=min(ctx, 2048), token_buckets=[min(ctx, 2048)],
                    progress=False, skip_tokenizer_init=True, num_pages=-(-max_len // 16) + 2, **kw)
    res = dict(start_s=time.perf_counter() - t0, compile_s=engine.compile_seconds)
    prompt = np.random.default_rng(0).integers(100, 1000, ctx).tolist()
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for _ in range(2):
        engine.stats = {k: 0 for k in engine.stats}
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        tokens = engine.take_finished(rid).outputs[0].token_ids
    res["tokens_sha"] = tokens_fingerprint(tokens)
    res["engine_step_ms"] = 1e3 * engine.stats["decode_seconds"] / engine.stats["decode_tokens"]
    # as a user sees it (first token to last), driven as `jaxinfer generate` drives the engine and as
    # the server's engine thread does when nobody arrives
    res["user_step_ms"] = user_step_ms(engine, prompt, params, server_loop=False)
    res["server_loop_step_ms"] = user_step_ms(engine, prompt, params, server_loop=True)
    res["launch_ms"] = launch_ms(engine, greedy)

    from bench.throughput import raw_decode_step_ms

    raw = raw_decode_step_ms(engine, 1, ctx, dispatches, greedy, "/tmp/trace-dispatch" if profile else None)
    if profile:
        raw, s = raw
        res.update({k: s.get(k) for k in ("kernels_per_step", "kernel_us_per_step", "busy_us_per_step",
                                           "span_us_per_step", "copies_per_step")})
    res["raw_step_ms"] = raw
    return res


def user_step_ms(engine, prompt, params, server_loop: bool) -> float:
    """ms per token from a request's first token to its last. server_loop: between steps, wait as the
    server's engine thread does with nobody arriving (until `engine.chain_at()`, or for the dispatch
    in flight to end while its batch size is not timed yet)."""
    rid = engine.add_request(prompt, params)
    first = last = None
    n = 0
    while engine.has_unfinished():
        if server_loop:   # as serve/async_engine.py's _wait_for_newcomers, with nobody arriving
            at = engine.chain_at()
            if at is None:
                engine.wait()
            else:
                while time.perf_counter() < at and not engine.inflight_done():
                    time.sleep(min(POLL, max(0.0, at - time.perf_counter())))
        for d in engine.step():
            if d.token_ids:
                last = time.perf_counter()
                if first is None:
                    first = last
                else:
                    n += len(d.token_ids)
    engine.take_finished(rid)
    return 1e3 * (last - first) / max(n, 1)


def launch_ms(engine, greedy: bool, n: int = 5) -> float:
    """Host time of one decode launch on an idle device (the call, not the dispatch): best of n."""
    import jax

    from jaxinfer.runner.model_runner import DecodeBatch
    from jaxinfer.sampling.sample import SamplingArrays

    r = engine.runner
    a = r.empty_decode(1)
    batch = jax.device_put(DecodeBatch(**a, sampling=SamplingArrays.from_params([], [], 1)))
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        batch, outs = r.launch_decode(batch, greedy=greedy)
        best = min(best, time.perf_counter() - t0)
        jax.block_until_ready(outs)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser()
    add_variant_args(ap, VARIANTS)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    model_dir = str(Path(args.models) / args.shape)
    if args.child:
        _, greedy, profile, options = VARIANTS[args.child]
        print("RESULT " + json.dumps(child(model_dir, args.ops, args.ctx, args.steps, greedy, profile, options)),
              flush=True)
        return
    from bench.random_model import bench_model

    bench_model(args.models, args.shape)
    rows = run_variants(__file__, {name: VARIANTS[name][0] for name in args.variants},
                        ["--shape", args.shape, "--ctx", str(args.ctx), "--steps", str(args.steps), "--ops", args.ops,
                         "--models", args.models], args.timeout)
    print(f"\n{args.shape}, context {args.ctx}, {args.steps} steps per dispatch")
    print_table(rows, [("variant", "variant", ""), ("engine step ms", "engine_step_ms", ".3f"),
                       ("user step ms", "user_step_ms", ".3f"), ("server-loop step ms", "server_loop_step_ms", ".3f"),
                       ("raw step ms", "raw_step_ms", ".3f"), ("launch ms", "launch_ms", ".3f"),
                       ("compile s", "compile_s", ".1f"), ("greedy tokens", "tokens_sha", "")])
    Path(args.out, "decode_dispatch.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
