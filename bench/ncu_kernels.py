"""The decode step's Pallas kernels under Nsight Compute (ncu): what each one's time is made of, on the H200.

    PYTHONPATH=. python3 bench/ncu_kernels.py [--shape qwen3-4b] [--batches 1 8] [--workload W] [--kernels REGEX]
                                              [--skip 600] [--count 14] [--block-in N] [--rows N] [--out DIR]
                                              [--int8-convert cvt|bits|prmt] [--weights int8|fp8|...]

On the H200, ncu's own process segfaults on the engine's workloads (`--workload engine`, `no-cudnn`, `synthetic`)
but takes one kernel family alone (`--workload qkv`, `gate-up`, `o-proj`, `down`, `attention`,
`attention-rope`, `skinny`, `skinny-gate-up`, `skinny-down`, `grouped-gate-up`, `grouped-down`, `routed-gate-up`,
`routed-combine`: ONE_KERNEL, called --tokens times on random inputs; use `--skip 1 --count 2`; the attention
workloads on an int8 cache with `--int8-convert`, the others on 8-bit weights with `--weights`). For the engine's workload: per batch, ncu runs a child (this file, --child) that builds
the engine and decodes --tokens greedy tokens after a 1,024-token prompt per sequence, XLA's command buffers off
so that every kernel is a launch of its own (the kernels are the same). ncu passes over the first --skip launches
of kernels whose names match --kernels (by default the decode step's Pallas kernels: the GEMVs, the batched-decode
GEMM, decode attention and its merge; the prompt steps run none of them) and profiles the next --count (about two
layers: six kernels a layer at batch 1) with its SpeedOfLight, LaunchStats, Occupancy and WarpStateStats sections,
the clocks left alone (--clock-control none) and the caches flushed before each kernel (ncu's default; a decode
step's weights come from HBM too). The machine must
let ncu read the counters (Firecracker machines do; gVisor ones do not). Prints per kernel: duration, DRAM
throughput as a share of peak, registers per thread, theoretical and achieved occupancy with the limiting resource,
and warp cycles per issued instruction; the reports are kept as $OUT/ncu-B{batch}.ncu-rep and .csv.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

KERNELS = "gemv|decode_attention|skinny_gemm"   # routed_gemv_* matches too
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats")
# (column, ncu's metric name on the details page)
# (L2 and L1 beside DRAM: a batch-1 GEMV program re-reads x, 2 bytes an input, for every output row it makes, from
# the caches; at 1-byte weights those reads can outweigh the weights' own)
COLUMNS = [("us", "Duration"), ("DRAM %", "DRAM Throughput"), ("L2 %", "L2 Cache Throughput"),
           ("L1 %", "L1/TEX Cache Throughput"), ("grid", "Grid Size"), ("block", "Block Size"),
           ("regs", "Registers Per Thread"), ("theor. occ. %", "Theoretical Occupancy"),
           ("achieved occ. %", "Achieved Occupancy"), ("waves", "Waves Per SM"),
           ("cycles / issue", "Warp Cycles Per Issued Instruction")]
LIMITS = ("Block Limit Registers", "Block Limit Shared Mem", "Block Limit Warps", "Block Limit SM")
# duration units as ncu versions spell them
TO_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def find_ncu() -> str | None:
    """ncu on the PATH, else the newest under /opt/nvidia/nsight-compute."""
    found = shutil.which("ncu")
    if found:
        return found
    installed = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    return installed[-1] if installed else None


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_details(text: str) -> list[dict]:
    """ncu's `--csv --page details` output -> one dict a profiled kernel launch, in launch order: its name, and
    each metric's value (floats where they parse; durations in microseconds)."""
    rows = [line for line in text.splitlines() if line.startswith('"')]   # ncu's own ==PROF== lines are not CSV
    kernels: dict[str, dict] = {}
    for r in csv.DictReader(io.StringIO("\n".join(rows))):
        k = kernels.setdefault(r["ID"], {"ID": int(r["ID"]), "kernel": r["Kernel Name"]})
        value = number(r["Metric Value"])
        if r["Metric Name"] == "Duration" and value is not None:
            value *= TO_US.get(r["Metric Unit"], float("nan"))
        k[r["Metric Name"]] = value if value is not None else r["Metric Value"]
    return sorted(kernels.values(), key=lambda k: k["ID"])


def limiter(k: dict) -> str:
    """The resource that caps a kernel's blocks per SM the most (ncu's Block Limit rows; ties: all of them)."""
    limits = {name.removeprefix("Block Limit "): k[name] for name in LIMITS if isinstance(k.get(name), float)}
    if not limits:
        return "-"
    low = min(limits.values())
    return "/".join(n for n, v in limits.items() if v == low) + f" ({low:.0f})"


def table(kernels: list[dict]) -> str:
    def cell(k, metric):
        v = k.get(metric)
        if v is None:
            return "-"
        if not isinstance(v, float):   # a value ncu gives as text (e.g. a launch's dimensions)
            return str(v)
        return f"{v:,.2f}" if metric == "Duration" else f"{v:,.4g}"

    head = ["kernel", *(c for c, _ in COLUMNS), "blocks/SM limited by"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in kernels:
        name = k["kernel"].split("(")[0][:48]
        lines.append("| " + " | ".join([name, *(cell(k, m) for _, m in COLUMNS), limiter(k)]) + " |")
    return "\n".join(lines)


def child(args) -> None:
    """The workload ncu watches: B sequences of a 1,024-token prompt each, then --tokens greedy tokens."""
    from bench.throughput import engine_for, run_all
    from jaxinfer.model.config import load_config
    from bench.random_model import bench_model
    from jaxinfer.sampling import SamplingParams

    if args.workload in ONE_KERNEL:
        one_kernel(args.workload, args.shape, args.batch, args.context, args.tokens, args.block_in, args.rows,
                   args.int8_convert, args.weights)
        print(f"# child: {args.workload} called {args.tokens} times", flush=True)
        return
    model_dir = args.model or bench_model(args.models, args.shape)
    cfg = load_config(model_dir, "bfloat16")
    t0 = time.perf_counter()
    options = {"fresh_prompt_attention": False} if args.workload == "no-cudnn" else {}
    engine = engine_for(model_dir, args.ops, args.batch, args.context + args.tokens + 16, compile_all_at_start=False,
                        enable_prefix_caching=False, **options)
    print(f"# child: engine built in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.workload == "synthetic":
        synthetic_decode(engine, args.batch, args.context, args.tokens)
        print(f"# child: {args.tokens} synthetic decode dispatches, {time.perf_counter() - t0:.0f} s in all",
              flush=True)
        return
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, cfg.vocab_size - 100, args.context).tolist() for _ in range(args.batch)]
    print("# child: prompts queued", flush=True)
    run_all(engine, prompts, [SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)] * args.batch)
    print(f"# child: decoded {args.tokens} tokens, {time.perf_counter() - t0:.0f} s in all", flush=True)


def synthetic_decode(engine, B: int, context: int, dispatches: int) -> None:
    """The batch-B greedy decode step on an unwritten cache, without a prompt step: B rows at position `context`,
    each with its own pages (the same kernels and bytes as after real prompts; no cuDNN or cuBLAS prompt kernels)."""
    import jax

    from jaxinfer.runner.batch import DecodeBatch
    from jaxinfer.sampling.sample import SamplingArrays
    from jaxinfer.runner.transfer import to_device

    r = engine.runner
    bucket = r.batch_bucket(B)
    a = r.empty_decode(bucket)
    per_seq = -(-(context + 1) // r.page_size)
    for b in range(B):
        a["tokens"][b] = 100 + b
        a["positions"][b] = context
        a["page_table"][b, :per_seq] = 1 + b * per_seq + np.arange(per_seq)
        a["state_row"][b] = b
        a["remaining"][b] = 1 << 20
        a["active"][b] = True
    batch = to_device(DecodeBatch(**a, sampling=SamplingArrays.from_params([], [], bucket)))
    variant = r.decode_variant("greedy", bucket)
    out = None
    for _ in range(dispatches):
        batch, out = r.launch_decode(batch, variant)
    jax.block_until_ready(out)
    print(f"# child: rows now at positions {np.asarray(batch.positions)[:B].tolist()}", flush=True)


# One Pallas kernel family alone at the shape's sizes (to find which one ncu cannot take): name -> what it runs
# (the GEMVs with the block_in and rows the engine's ops give them: ops/pallas.py `_gemv`)
ONE_KERNEL = {"qkv": "fused_gemv with the norm prologue (QKV)", "gate-up": "fused_gemv with SwiGLU (gate/up)",
              "o-proj": "fused_gemv with the residual (o_proj)", "down": "fused_gemv with the residual (down)",
              "attention": "paged_decode_attention (split kernel and merge)",
              "attention-rope": "decode_attention_rope_write (the engine's: q/k norm, RoPE, cache write, split "
              "kernel and merge)", "skinny": "skinny_gemm (QKV)", "skinny-gate-up": "skinny_gemm with SwiGLU",
              "skinny-down": "skinny_gemm with the residual (down)",
              "grouped-gate-up": "grouped_gemm with SwiGLU (a mixture of experts' gate/up; B rows over the experts)",
              "grouped-down": "grouped_gemm (a mixture of experts' down; B rows over the experts)",
              "routed-gate-up": "routed_gemv with the norm, routing and SwiGLU (one token's chosen experts' gate/up)",
              "routed-combine": "routed_gemv combining the chosen experts' down products into the residual"}


def _scale_or_none(w_scale: list | tuple):
    """A workload's optional trailing scale operand (its fn's *w_scale): the scales where 8-bit, else None."""
    return w_scale[0] if w_scale else None


def kernel_call(name: str, shape: str, B: int, context: int, block_in: int | None = None, rows: int | None = None,
                interpret: bool = False, int8_convert: str | None = None, weights: str = "bf16"):
    """(fn, args): one kernel family (ONE_KERNEL) at `shape`'s sizes for B rows, as a function of its arrays. An arg
    is a jax.ShapeDtypeStruct (any values do: fill it at random) or a small concrete array (page tables, lengths,
    slots, angles). block_in / rows: a GEMV's, instead of the engine's. int8_convert: the attention workloads on an int8
    cache (values and scales) with that conversion (decode_attention.int8_to). weights "int8" / "fp8": the GEMV, skinny
    and grouped workloads on 8-bit values with a scale an output channel (the GEMVs with the block_in, rows, warps and
    conversion the engine's ops give them; the GEMMs at their choose_config). "int8-w8a8" / "fp8-w8a8": the same,
    with the skinny and grouped workloads in W8A8 (x's rows in the weights' format with a scale each, 8-bit tile
    products). The
    grouped workloads spread the B rows evenly over a mixture of experts' experts (the shape must have them)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.config import config_from_hf
    from jaxinfer.pallas.decode_attention import paged_decode_attention
    from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write
    from jaxinfer.pallas.fused_gemv import block_in_for, fused_gemv, int8_convert_for, rows_for, warps_for
    from jaxinfer.pallas.skinny_gemm import skinny_gemm
    from bench.random_model import SHAPES

    cfg = config_from_hf(SHAPES[shape], "bfloat16")
    D, hd, H, K = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def spec(*dims):
        return jax.ShapeDtypeStruct(dims, jnp.bfloat16)

    w8a8 = weights.endswith("-w8a8")
    weights = weights.removesuffix("-w8a8")
    w_dtype = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[weights]
    if w8a8 and weights == "bf16":
        raise ValueError("W8A8 workloads need 8-bit weights (int8-w8a8 or fp8-w8a8)")

    def weight_specs(*dims):   # the values, and their scales (one an output channel) where 8-bit
        if weights == "bf16":
            return [spec(*dims)]
        return [jax.ShapeDtypeStruct(dims, w_dtype), jax.ShapeDtypeStruct(dims[:-1], jnp.float32)]

    if name.startswith("attention"):   # B rows at position `context`, each with its own pages of the cache
        page, pages = 16, -(-(context + 1) // 16)
        cache = spec(1, K, B * pages * page, hd)
        table = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)
        lens = jnp.full((B,), context + 1, jnp.int32)
        int8 = [] if int8_convert is None else [jax.ShapeDtypeStruct(cache.shape[:-1], jnp.float32)] * 2
        if int8:
            cache = jax.ShapeDtypeStruct(cache.shape, jnp.int8)
        quantized = (lambda scales: dict(k_scale=scales[0], v_scale=scales[1], int8_convert=int8_convert)) \
            if int8 else (lambda scales: {})
        if name == "attention":
            def fn(q, kc, vc, table, lens, *scales):
                return paged_decode_attention(q, kc, vc, jnp.int32(0), table, lens, page, hd ** -0.5,
                                              interpret=interpret, **quantized(scales))
            return fn, [spec(B, H, hd), cache, cache, table, lens, *int8]
        slot = table[:, context // page] * page + context % page
        angles = jnp.linspace(0, 3, B * hd, dtype=jnp.float32).reshape(B, hd)

        def fn(qkv, cos, sin, qn, kn, kc, vc, slot, table, lens, *scales):
            return decode_attention_rope_write(qkv, cos, sin, qn, kn, kc, vc, jnp.int32(0), slot, table, lens,
                                               page_size=page, scale=hd ** -0.5, num_heads=H, num_kv_heads=K,
                                               interpret=interpret, **quantized(scales))[0]
        return fn, [spec(B, (H + 2 * K) * hd), jnp.cos(angles), jnp.sin(angles), spec(1, hd), spec(1, hd), cache,
                    cache, slot, table, lens, *int8]
    if name.startswith("routed"):   # one token (B is 1), as ops.pallas._routed_block calls them
        from jaxinfer.pallas.moe_gemv import routed_gemv

        E, I, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        route = dict(top_k=k, renormalize=cfg.norm_topk_prob, interpret=interpret)
        logits = jax.ShapeDtypeStruct((1, E), jnp.float32)
        if name == "routed-gate-up":
            def fn(x, logits, scale, w, *w_scale):
                return routed_gemv(x, logits, w, 0, epilogue="swiglu", scale=scale,
                                   w_scale=_scale_or_none(w_scale), **route)
            return fn, [spec(1, D), logits, spec(D), *weight_specs(1, E, 2 * I, D)]

        def fn(h, logits, residual, w, *w_scale):
            return routed_gemv(h, logits, w, 0, epilogue="combine", residual=residual,
                               w_scale=_scale_or_none(w_scale), **route)
        return fn, [spec(k, I), logits, spec(1, D), *weight_specs(1, E, D, I)]
    if name.startswith("grouped"):   # B rows sorted by expert, spread evenly, one layer's stacked experts
        from jaxinfer.pallas.grouped_gemm import choose_config, grouped_gemm, sorted_items

        E, I = cfg.num_experts, cfg.moe_intermediate_size
        sizes = jnp.full((E,), B // E, jnp.int32).at[: B % E].add(1)
        epilogue = "swiglu" if name == "grouped-gate-up" else "none"
        n_out, n_in = (2 * I, D) if epilogue == "swiglu" else (D, I)
        block_m = choose_config(B / E, n_out, n_in, epilogue).block_m   # the kernel's own config for B / E rows

        if w8a8:   # x's rows in the experts' format, a float32 scale each
            def fn(x, w, w_scale, x_scale):
                return grouped_gemm(x, w, sorted_items(sizes, B, block_m), epilogue=epilogue, interpret=interpret,
                                    w_scale=w_scale, x_scale=x_scale, out_dtype=jnp.bfloat16)
            return fn, [jax.ShapeDtypeStruct((B, n_in), w_dtype), *weight_specs(1, E, n_out, n_in),
                        jax.ShapeDtypeStruct((B,), jnp.float32)]

        def fn(x, w, *w_scale):
            return grouped_gemm(x, w, sorted_items(sizes, B, block_m), epilogue=epilogue, interpret=interpret,
                                w_scale=_scale_or_none(w_scale))
        return fn, [spec(B, n_in), *weight_specs(1, E, n_out, n_in)]
    n_out, n_in = {"qkv": (cfg.q_size + 2 * cfg.kv_size, D), "gate-up": (2 * cfg.intermediate_size, D),
                   "o-proj": (D, cfg.q_size), "down": (D, cfg.intermediate_size),
                   "skinny": (cfg.q_size + 2 * cfg.kv_size, D), "skinny-gate-up": (2 * cfg.intermediate_size, D),
                   "skinny-down": (D, cfg.intermediate_size)}[name]
    rows_out = n_out // 2 if name in ("gate-up", "skinny-gate-up") else n_out   # SwiGLU: keyed by gate rows
    gemv = dict(block_in=block_in or block_in_for(rows_out, n_in, w_dtype),
                rows=rows or rows_for(rows_out, n_in, w_dtype), num_warps=warps_for(rows_out, n_in, w_dtype),
                int8_convert=int8_convert_for(rows_out, n_in) if weights == "int8" else None, interpret=interpret)
    fns = {"qkv": lambda x, w, v, **q: fused_gemv(x, w, 0, scale=v, **gemv, **q),
           "gate-up": lambda x, w, v, **q: fused_gemv(x, w, 0, scale=v, epilogue="swiglu", **gemv, **q),
           "o-proj": lambda x, w, v, **q: fused_gemv(x, w, 0, residual=v, epilogue="residual", **gemv, **q),
           "down": lambda x, w, v, **q: fused_gemv(x, w, 0, residual=v, epilogue="residual", **gemv, **q),
           "skinny": lambda x, w, v, **q: skinny_gemm(x, w, 0, interpret=interpret, **q),
           "skinny-gate-up": lambda x, w, v, **q: skinny_gemm(x, w, 0, epilogue="swiglu", interpret=interpret, **q),
           "skinny-down": lambda x, w, v, **q: skinny_gemm(x, w, 0, residual=v, epilogue="residual",
                                                           interpret=interpret, **q)}
    vector = spec(n_in) if name in ("qkv", "gate-up") else spec(B, n_out)   # the norm's scale, or the residual
    w_args = weight_specs(1, n_out, n_in)
    if w8a8 and name.startswith("skinny"):   # x's rows in the weights' format, a float32 scale each
        def fn(x, w, v, w_scale, x_scale):
            return fns[name](x, w, v, w_scale=w_scale, x_scale=x_scale, out_dtype=jnp.bfloat16)
        return fn, [jax.ShapeDtypeStruct((B, n_in), w_dtype), *w_args[:1], vector, *w_args[1:],
                    jax.ShapeDtypeStruct((B,), jnp.float32)]

    def fn(x, w, v, *w_scale):
        return fns[name](x, w, v, w_scale=_scale_or_none(w_scale))
    return fn, [spec(B, n_in), w_args[0], vector, *w_args[1:]]


def one_kernel(name: str, shape: str, B: int, context: int, calls: int, block_in: int | None = None,
               rows: int | None = None, int8_convert: str | None = None, weights: str = "bf16") -> None:
    """`calls` calls of one kernel family (kernel_call; int8_convert: an int8 cache; weights: 8-bit ones) on random
    inputs (interpret mode on a CPU)."""
    import jax
    import jax.numpy as jnp

    fn, args = kernel_call(name, shape, B, context, block_in, rows, interpret=jax.default_backend() == "cpu",
                           int8_convert=int8_convert, weights=weights)
    keys = iter(jax.random.split(jax.random.key(0), len(args)))
    args = [random_like(next(keys), a) if isinstance(a, jax.ShapeDtypeStruct) else a for a in args]
    print(f"# child: {name}, operand dtypes {sorted({str(a.dtype) for a in args})}", flush=True)
    f = jax.jit(fn)
    outs = [f(*args) for _ in range(calls)]
    jax.block_until_ready(outs)
    assert all(bool(jnp.isfinite(o.astype(jnp.float32)).all()) for o in outs), name


def random_like(key, a):
    """Values for a kernel_call arg: floats near 1 (scales too), 8-bit weights and cache values spread over their
    range (int8 -127..127, e4m3 +-[0, 2])."""
    import jax
    import jax.numpy as jnp

    if a.dtype == jnp.int8:
        return jax.random.randint(key, a.shape, -127, 128, jnp.int32).astype(jnp.int8)
    if a.dtype == jnp.float8_e4m3fn:
        return (2 * jax.random.uniform(key, a.shape) - 1).astype(a.dtype)
    return (1 + 0.02 * jax.random.normal(key, a.shape)).astype(a.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kernels", default=KERNELS, help="regex over kernel names")
    ap.add_argument("--skip", type=int, default=600, help="matching launches passed over first (warm-up)")
    ap.add_argument("--count", type=int, default=14, help="matching launches profiled")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ops", default="pallas")
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--model", default=None, help="a model folder instead of random weights at --shape")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--workload", default="engine", choices=["engine", "no-cudnn", "synthetic", *ONE_KERNEL],
                    help="what ncu watches: the engine's requests; the same with the prompt's attention on our "
                         "kernel instead of cuDNN; decode dispatches on an unwritten cache (no prompt step); or one "
                         "Pallas kernel family alone (ONE_KERNEL), called --tokens times")
    ap.add_argument("--block-in", type=int, default=None, help="a one-kernel GEMV's block_in (default: the engine's)")
    ap.add_argument("--rows", type=int, default=None, help="a one-kernel GEMV's rows a program (default: the engine's)")
    ap.add_argument("--int8-convert", choices=["cvt", "bits", "prmt"], default=None,
                    help="the attention workloads on an int8 cache, converted so")
    ap.add_argument("--weights", choices=["bf16", "int8", "fp8", "int8-w8a8", "fp8-w8a8"], default="bf16",
                    help="the GEMV, skinny and grouped workloads' weights (kernel_call)")
    ap.add_argument("--timeout", type=float, default=170, help="seconds for each batch's ncu run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    ncu = find_ncu()
    if ncu is None:
        raise SystemExit("ncu (Nsight Compute) is not on this machine")
    from bench.variant_runs import NO_COMMAND_BUFFERS

    if not args.model and args.workload not in ONE_KERNEL:   # weights written outside ncu, at full speed
        subprocess.run([sys.executable, "-c", "from bench.random_model import bench_model; "
                        f"bench_model({args.models!r}, {args.shape!r})"], check=True)
    # ncu's kernel replay saves and restores the device memory a kernel may write; JAX's usual pool (75% of the
    # card, one allocation) would make each replay copy ~100 GB, so the pool grows as needed here. XLA's GEMM
    # autotuner is kept from timing kernels under ncu, and a crash prints the Python stack.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONFAULTHANDLER": "1",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {NO_COMMAND_BUFFERS} --xla_gpu_autotune_level=0".strip()}
    for B in args.batches:
        tag = "" if args.workload == "engine" else f"-{args.workload}"
        tag += (f"-in{args.block_in}" if args.block_in else "") + (f"-rows{args.rows}" if args.rows else "")
        tag += (f"-kv-int8-{args.int8_convert}" if args.int8_convert else "") + \
            (f"-{args.weights}" if args.weights != "bf16" else "")
        report = os.path.join(args.out, f"ncu-B{B}{tag}")
        work = [sys.executable, os.path.abspath(__file__), "--child", "--batch", str(B), "--shape", args.shape,
                "--tokens", str(args.tokens), "--context", str(args.context), "--ops", args.ops,
                "--workload", args.workload, *(["--block-in", str(args.block_in)] if args.block_in else []),
                *(["--rows", str(args.rows)] if args.rows else []),
                *(["--int8-convert", args.int8_convert] if args.int8_convert else []), "--weights", args.weights,
                "--models",
                args.models] + (["--model", args.model] if args.model else [])
        # --apply-rules no: the rules' advice is not read here (turning them off did not stop the engine
        # workloads' crash)
        cmd = [ncu, "--clock-control", "none", "--apply-rules", "no", "--target-processes", "all",
               "--kernel-name", f"regex:{args.kernels}",
               "--launch-skip", str(args.skip), "--launch-count", str(args.count),
               *(a for s in SECTIONS for a in ("--section", s)), "-f", "-o", report, *work]
        print("# " + " ".join(cmd), flush=True)
        log = report + ".log"   # ncu's and the child's output, kept even when the run is cut short
        with open(log, "w") as f:
            # its own process group: on a timeout the child goes with ncu (it would hold the GPU otherwise)
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"timed out after {args.timeout:.0f} s"
        if rc:
            with open(log) as f:
                print(f.read()[-3000:], flush=True)
            raise SystemExit(f"ncu failed for batch {B} ({rc})")
        details = subprocess.run([ncu, "-i", report + ".ncu-rep", "--csv", "--page", "details"], capture_output=True,
                                 text=True, check=True).stdout
        with open(report + ".csv", "w") as f:
            f.write(details)
        kernels = parse_details(details)
        if not kernels:   # fewer matching launches than --skip: nothing was profiled
            print(f"# batch {B}: no launch profiled (fewer than {args.skip} matched {args.kernels!r}?)", flush=True)
            continue
        print(f"\n{args.shape}, batch {B}, context {args.context}: {len(kernels)} launches after {args.skip}\n"
              + table(kernels), flush=True)


if __name__ == "__main__":
    main()
