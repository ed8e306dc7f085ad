"""Batch-1 decode on the GPU against the bandwidth roofline: Pallas path, XLA reference path, transformers.

    PYTHONPATH=. python3 bench/decode.py [--shapes qwen3-0.6b qwen3-4b llama3-8b] [--paths pallas reference hf hf-compile]
                                         [--prompt 1024] [--new 128] [--long qwen3-4b:8192] [--out DIR]
                                         [--quantization int8 fp8] [--kv int8 fp8]

Random bf16 weights at real shapes are written as safetensors (bench.random_model) and loaded
through our own loader (and by transformers for the peer: `hf` is eager with a dynamic cache,
`hf-compile` a static cache under torch.compile, bench/hf_peer.py; its compile takes minutes). Greedy decode of `--new` tokens after a
random prompt of `--prompt` tokens. The roofline is the bytes a step must read (every weight but
the input embedding table, plus the KV rows at the step's context) over the HBM read bandwidth
measured in this run by a large reduction. Prints one table; writes decode.json and decode.png.

--quantization int8 (fp8): each of our paths runs again with its weights quantized at load (a path "pallas+int8";
"pallas+int8-fp8" with a float8 KV cache too). A quantized row's roofline counts the bytes its loaded parameters
hold (8-bit values and their scales; the input embedding, kept in bf16, one row), its speed-up is over the same path
in bf16 in this run, and its greedy tokens are compared with the quantized reference path's, where that ran.
--kv int8 (fp8): each of our paths runs again with that KV cache ("pallas-int8kv", "pallas+int8-int8kv"; a path
named with "-fp8" or "-int8kv" runs so too). Its roofline counts the cache's bytes (int8: a byte a value and a
4-byte scale a vector; fp8: a byte a value), its "x bf16 KV" the speed-up over the same path with the bf16 cache, and
its greedy tokens are compared with the reference path's of the same weights and cache. The int8 cache at 32k:
    PYTHONPATH=. python3 bench/decode.py --shapes --long qwen3-4b:32768 --paths pallas --quantization int8 --kv int8
(an empty --shapes: only the --long cases)
--profile PATHS traces those paths: kernels a step, and a layer (the step's count over the layers).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for the torch peer

import jax
import numpy as np

from bench.ceilings import hbm_read_ceiling
from bench.trace_kernels import keep_command_buffers_when_profiling, trace_engine_decode
from jaxinfer.model.config import load_config
from jaxinfer.engine.engine import Engine
from bench.random_model import bench_model
from jaxinfer.sampling import SamplingParams


def step_bytes(cfg, context: float, kv_item: float = 2) -> float:
    """Bytes one batch-1 decode step must read: bf16 weights (the input embedding is one row; of a mixture of
    experts the router and the active experts only) + KV at `context` (kv_item bytes a value: 1 with a float8
    cache, kv_item_bytes)."""
    weights = cfg.active_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings else 1)
    return 2 * weights + kv_step_bytes(cfg, context, kv_item)


def kv_step_bytes(cfg, context: float, kv_item: float = 2) -> float:
    """Bytes of the KV rows one batch-1 decode step reads at `context`."""
    return kv_item * 2 * cfg.num_layers * context * cfg.kv_size


KV_SUFFIXES = {"fp8": "-fp8", "int8": "-int8kv"}   # a path's KV cache dtype, named at its end


def without_kv(path: str) -> str:
    """The path with its KV cache suffix taken off: "pallas+int8-int8kv" -> "pallas+int8"."""
    for suffix in KV_SUFFIXES.values():
        path = path.removesuffix(suffix)
    return path


def quantization_of(path: str) -> str | None:
    """A path's weight quantization: "pallas+int8" -> "int8" (a final "-fp8" or "-int8kv" names the KV cache's
    dtype)."""
    return without_kv(path).partition("+")[2] or None


def kv_item_bytes(cfg, kv: str) -> float:
    """Bytes a cached value costs: 2 (bf16), 1 (fp8), 1 + 4 / head_dim (int8: a float32 scale a vector)."""
    return {"auto": 2.0, "fp8": 1.0, "int8": 1.0 + 4.0 / cfg.head_dim}[kv]


def param_step_bytes(params) -> int:
    """Bytes of the loaded parameters a decode step reads: all of them, less the input embedding where the lm_head is
    a matrix of its own (the embedding is read one row a token)."""
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    return total - (params["embed"].nbytes if "lm_head" in params else 0)


def kv_of(path: str) -> str:
    """A path's KV cache dtype: "-fp8" at the end of a jaxinfer path asks for float8 pages, "-int8kv" for int8 ones."""
    return next((kv for kv, suffix in KV_SUFFIXES.items() if path.endswith(suffix)), "auto")


def run_jaxinfer(model_dir: Path, path: str, prompt: list[int], new: int, steps: int,
                 profile_dir: str | None = None, tensor_parallel_size: int = 1) -> dict:
    """path: an ops backend ("pallas", "reference"); "-unroll" / "-scan" force the layer loop's form
    (default: the engine's, unrolled on GPUs); a final "-fp8" keeps the KV cache in float8, "-int8kv" in int8."""
    kv_cache_dtype = kv_of(path)
    quantization = quantization_of(path)
    path = without_kv(path).partition("+")[0]
    ops = path.removesuffix("-unroll").removesuffix("-scan")
    unroll = True if path.endswith("-unroll") else False if path.endswith("-scan") else None
    chunk = min(len(prompt), 2048)
    # every step compiled at start-up (compile_s), none inside the timed requests
    engine = Engine(model_dir, dtype="bfloat16", ops=ops, unroll_layers=unroll, max_num_seqs=1,
                    compile_all_at_start=True, max_model_len=len(prompt) + new + 16,
                    max_num_batched_tokens=chunk, token_buckets=[chunk], decode_steps=steps, progress=False,
                    skip_tokenizer_init=True, max_logprobs=0, kv_cache_dtype=kv_cache_dtype,  # max_logprobs 0: no top-k
                    num_pages=-(-(len(prompt) + new + 16) // 16) + 1,  # one sequence's pages, as measured
                    tensor_parallel_size=tensor_parallel_size,
                    **(dict(quantization=quantization) if quantization else {}))
    weight_bytes = param_step_bytes(engine.runner.params)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    out = None
    for _ in range(2):  # the first request warms up whatever compilation did not
        engine.stats = {k: 0 for k in engine.stats}
        rid = engine.add_request(prompt, params)
        t0 = time.perf_counter()
        first = done = None
        while engine.has_unfinished():
            for d in engine.step():
                if d.request_id == rid and d.token_ids and first is None:
                    first = time.perf_counter() - t0
                if d.request_id == rid and d.finished:
                    done = time.perf_counter() - t0
        out = engine.take_finished(rid)
    s = engine.stats
    prof = trace_engine_decode(engine, [prompt], [params], profile_dir) if profile_dir else None
    # step_ms: as the user sees it, first token to last over the tokens in between; the engine's own
    # figure also counts dispatches that ran past the request's end.
    res = dict(profile=prof, step_ms=1e3 * (done - first) / (len(out.outputs[0].token_ids) - 1), ttft_ms=1e3 * first,
               engine_step_ms=1e3 * s["decode_seconds"] / s["decode_tokens"],
               tokens=out.outputs[0].token_ids, compile_s=engine.compile_seconds, weight_bytes=weight_bytes)
    if prof and "kernels_per_step" in prof:   # counted in the trace (the compiled HLO's count misleads)
        res.update(kernels_per_step=round(prof["kernels_per_step"], 1),
                   kernels_per_layer=round(prof["kernels_per_step"] / engine.cfg.num_layers, 1),
                   kernel_us_per_step=round(prof["kernel_us_per_step"], 1))
    del engine
    gc.collect()
    return res


def run_hf(model_dir: Path, prompt: list[int], new: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            ttft = time.perf_counter() - t0
            past, tokens = out.past_key_values, [int(tok)]
            t0 = time.perf_counter()
            for _ in range(new - 1):
                out = model(input_ids=tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(tok))
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
    del model, past, out
    torch.cuda.empty_cache()
    return dict(step_ms=1e3 * dt / (new - 1), ttft_ms=1e3 * ttft, tokens=tokens, setup="eager, dynamic cache")


def print_table(rows: list[dict]) -> None:
    print("\n| shape | context | path | step ms | tok/s | roofline ms | share of roofline | TTFT ms | "
          "kernels per step (traced) | kernels a layer | x bf16 path | x bf16 KV | greedy tokens equal to reference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['context']} | {r['path']} | failed: {r['error'][:80]} | | | | | | | | | |")
            continue
        print(f"| {r['shape']} | {r['context']} | {r['path']} | {r['step_ms']:.3f} | {r['tok_s']:.0f} | "
              f"{r['roofline_ms']:.3f} | {100 * r['roofline_share']:.1f}% | {r['ttft_ms']:.1f} | "
              f"{r.get('kernels_per_step', '-')} | {r.get('kernels_per_layer', '-')} | {r.get('speedup_vs_bf16', '-')} | "
              f"{r.get('speedup_vs_bf16_kv', '-')} | {r.get('greedy_match_vs_reference', '-')} |")


def write_json(rows: list[dict], bw: float, out: Path) -> None:
    (out / "decode.json").write_text(json.dumps(dict(bandwidth=bw, device=jax.devices()[0].device_kind, rows=rows),
                                                indent=1))


def plot(rows: list[dict], out: Path) -> None:
    """decode.png: share of the roofline by case and path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ok = [r for r in rows if "step_ms" in r]
        labels = list(dict.fromkeys(f"{r['shape']}@{r['context']}" for r in ok))
        paths = list(dict.fromkeys(r["path"] for r in ok))
        fig, ax = plt.subplots(figsize=(9, 4))
        for i, p in enumerate(paths):
            vals = [next((100 * r["roofline_share"] for r in ok if r["path"] == p and f"{r['shape']}@{r['context']}" == l), 0)
                    for l in labels]
            ax.bar(np.arange(len(labels)) + i * 0.8 / len(paths), vals, 0.8 / len(paths), label=p)
        ax.set_xticks(np.arange(len(labels)) + 0.4 - 0.4 / len(paths), labels)
        ax.set_ylabel("% of bandwidth roofline")
        ax.axhline(90, color="gray", ls="--", lw=0.8)
        ax.legend()
        ax.set_title(f"batch-1 decode, bf16, {jax.devices()[0].device_kind}")
        fig.tight_layout()
        fig.savefig(out / "decode.png", dpi=120)
    except Exception as e:
        print(f"# no plot: {e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qwen3-0.6b", "qwen3-4b", "llama3-8b"])
    ap.add_argument("--paths", nargs="+", default=["pallas", "reference", "hf"])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--long", nargs="*", default=["qwen3-4b:8192"], help="more cases as shape:context")
    ap.add_argument("--hf-for", nargs="*", default=None, help="shapes to run the transformers peer on (default all)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per dispatch")
    ap.add_argument("--profile", nargs="*", default=[], help="paths to trace (kernel time against step time)")
    ap.add_argument("--quantization", nargs="*", default=[], choices=["int8", "fp8"],
                    help="run each of our paths again with its weights quantized at load (path+int8)")
    ap.add_argument("--kv", nargs="*", default=[], choices=list(KV_SUFFIXES),
                    help="run each of our paths again with this KV cache dtype (path-int8kv, path-fp8)")
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="our paths over this many devices (the roofline: each reads 1/N of the bytes; "
                         "leave out the hf paths)")
    args = ap.parse_args()
    keep_command_buffers_when_profiling(bool(args.profile))   # before the first use of the GPU
    args.paths += [without_kv(p) + f"+{q}" + KV_SUFFIXES.get(kv_of(p), "")
                   for q in args.quantization for p in args.paths if not p.startswith("hf")]
    # each of our paths followed by its runs with the --kv caches: pallas, pallas-int8kv, pallas+int8, ...
    args.paths = [v for p in args.paths for v in [p] + [p + KV_SUFFIXES[kv] for kv in args.kv
                                                       if not p.startswith("hf") and kv_of(p) == "auto"]]

    bw = hbm_read_ceiling(4 if jax.devices()[0].platform == "gpu" else 0.125)  # small on a CPU smoke run
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; HBM read bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    cases = [(s, args.prompt) for s in args.shapes] + [(s, int(n)) for s, n in (x.split(":") for x in args.long)]
    rows = []
    for shape, ctx in cases:
        model_dir = bench_model(args.models, shape)
        cfg = load_config(model_dir, "bfloat16")
        prompt = np.random.default_rng(0).integers(100, cfg.vocab_size - 100, ctx).tolist()
        roof_bytes = step_bytes(cfg, ctx + args.new / 2)
        roof_ms = 1e3 * roof_bytes / bw / args.tensor_parallel_size
        results = {}
        for path in args.paths:
            if path.startswith("hf") and args.hf_for is not None and shape not in args.hf_for:
                continue
            if path.startswith("hf") and args.tensor_parallel_size > 1:   # transformers runs on one device here
                print(f"# tensor parallel size {args.tensor_parallel_size}: skipping {path} (one device; ours only)")
                continue
            try:
                t0 = time.perf_counter()
                if path == "hf-compile":   # static cache + torch.compile (bench/hf_peer.py)
                    from bench.hf_peer import run_hf_compiled

                    results[path] = run_hf_compiled(model_dir, prompt, args.new)
                else:
                    results[path] = run_hf(model_dir, prompt, args.new) if path == "hf" else \
                        run_jaxinfer(model_dir, path, prompt, args.new, args.steps,
                                     profile_dir=f"/tmp/trace-{shape}-{ctx}-{path}" if path in args.profile else None,
                                     tensor_parallel_size=args.tensor_parallel_size)
                results[path]["wall_s"] = time.perf_counter() - t0
            except Exception as e:  # a path that fails is reported, not fatal to the table
                results[path] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            r = results[path]
            kv_item = kv_item_bytes(cfg, kv_of(path))
            if kv_of(path) != "auto":   # its own roofline: the KV bytes are about half
                r.update(roofline_ms=1e3 * step_bytes(cfg, ctx + args.new / 2, kv_item=kv_item) / bw
                         / args.tensor_parallel_size)
            if quantization_of(path) and "weight_bytes" in r:   # the bytes its parameters hold
                r.update(roofline_ms=1e3 * (r["weight_bytes"] + kv_step_bytes(cfg, ctx + args.new / 2, kv_item)) / bw
                         / args.tensor_parallel_size)
            if "step_ms" in r:
                r.update(tok_s=1e3 / r["step_ms"], roofline_share=r.get("roofline_ms", roof_ms) / r["step_ms"])
                base = results.get(path.replace("+" + str(quantization_of(path)), ""), {})
                if quantization_of(path) and "step_ms" in base:
                    r.update(speedup_vs_bf16=round(base["step_ms"] / r["step_ms"], 3))
                base_kv = results.get(without_kv(path), {})   # the same weights with the bf16 cache
                if kv_of(path) != "auto" and "step_ms" in base_kv:
                    r.update(speedup_vs_bf16_kv=round(base_kv["step_ms"] / r["step_ms"], 3))
            print(f"# {shape} ctx {ctx} {path}: {json.dumps({k: v for k, v in r.items() if k not in ('tokens', 'profile')})}",
                  flush=True)
        for path, r in results.items():
            ref_tokens = next((o["tokens"] for p, o in results.items() if p.startswith("reference") and "tokens" in o
                               and quantization_of(p) == quantization_of(path) and kv_of(p) == kv_of(path)), None)
            if ref_tokens and "tokens" in r:
                r["greedy_match_vs_reference"] = int(np.argmin(np.array(r["tokens"]) == np.array(ref_tokens))) \
                    if r["tokens"] != ref_tokens else len(ref_tokens)
            rows.append({**dict(shape=shape, context=ctx, path=path, roofline_ms=roof_ms, step_bytes=roof_bytes),
                         **{k: v for k, v in r.items() if k != "tokens"}})   # (an fp8 path's own roofline_ms wins)
        gc.collect()
        write_json(rows, bw, Path(args.out))   # after every case: a case cut off by a time limit loses nothing before it

    print_table(rows)
    plot(rows, Path(args.out))


if __name__ == "__main__":
    main()
