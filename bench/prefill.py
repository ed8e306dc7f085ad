"""Time to first token against the dense bf16 GEMM rate: Pallas path, XLA reference path, transformers.

    PYTHONPATH=. python3 bench/prefill.py [--shapes qwen3-4b llama3-8b] [--prompts 128 1024 8192 32768]
                                          [--paths pallas reference hf] [--chunk 8192] [--out DIR]
                                          [--quantization fp8 int8] [--tensor-parallel-size N] [--sequences N]

A request of max_tokens=1 after a random prompt; TTFT is the wall time from submitting it to its
first token (prompts longer than --chunk are prefilled chunk by chunk). FLOPs counted: the
projections (2 * non-embedding parameters per token), the lm_head for the last token, and causal
attention (4 * heads * head_dim * visible keys per query, per layer). Share = FLOPs / TTFT over the
GEMM rate measured in this run (XLA, 8192^3). Random bf16 weights at real shapes, our loader. "start s": from
the engine's construction (transformers: from_pretrained) to the end of the warm-up run: loading, quantizing,
compiling and XLA's autotuning, which the TTFT leaves out.
--quantization fp8 (int8): each of our paths runs again with its weights quantized at load (a path "pallas+fp8";
EngineConfig.quantization), its speed-up over the same path in bf16 in this run in the last column. Its share is still
of the bf16 GEMM rate (fp8 tensor cores, W8A8 from tables.FP8_W8A8_ROWS rows, can pass 100%). --fp8-tables JSON:
FP8_W8A8_ROWS (and SKINNY_GEMM_8BIT) as a bench/kernels/quantized_gemv.py --fp8-rows run measured them.
--tensor-parallel-size N: our paths over N devices (docs/tensor_parallel.md); the share is then of N devices' GEMM
rate (the measured one device's rate x N), TFLOP/s the aggregate. The hf paths are skipped with a note (transformers
runs on one device); 8-bit weights are split as the bf16 ones (docs/tensor_parallel.md); a
tensor-parallel engine runs the prompt step as one executable, so pallas-split6 is then pallas-one-step. Each row's
JSON holds the prompt's first greedy token, to compare across TP sizes.
--sequences N: each prompt's tokens as N prompts of 1/N of them, submitted together (one prompt step of N sequences
when the chunk holds them all); TTFT is until the last one's first token, and the lm_head runs on N rows (FLOPs counted
so: N causal attentions of T/N tokens, N lm_head rows).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from bench.ceilings import dense_gemm_rate
from bench.trace_kernels import keep_command_buffers_when_profiling
from jaxinfer.model.config import load_config
from jaxinfer.engine.engine import Engine
from bench.random_model import bench_model
from jaxinfer.sampling import SamplingParams


def prefill_flops(cfg, T: int, sequences: int = 1) -> float:
    body = cfg.active_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    t = T // sequences
    attention = 4 * cfg.num_layers * cfg.q_size * sequences * t * (t + 1) / 2
    return 2 * body * T + 2 * cfg.vocab_size * cfg.hidden_size * sequences + attention


# Paths besides ops names: engine settings to compare side by side
PATH_OPTIONS = {"pallas-paged": ("pallas", {"fresh_prompt_attention": False}),  # the paged kernel for a fresh prompt
                # a long prompt's later chunks on cuDNN too (Tuning.prefixed_chunk_attention)
                "pallas-prefixed": ("pallas", {"prefixed_chunk_attention": True}),
                # the prompt step as two executables, its first 6 layers apart (Tuning.prompt_step_head_layers)
                "pallas-split6": ("pallas", {"prompt_step_head_layers": 6}),
                # the prompt step as one executable (the former GPU default)
                "pallas-one-step": ("pallas", {"prompt_step_head_layers": 0})}


def ttft_jaxinfer(model_dir: Path, path: str, prompt: list[int], chunk: int, repeats: int = 3,
                  profile_dir: str | None = None, tensor_parallel_size: int = 1,
                  sequences: int = 1) -> tuple[float, int, float]:
    """The best TTFT in seconds over `repeats` runs after a warm-up, the first (greedy) token, and the seconds from
    the engine's construction to the end of the warm-up (load, quantization, compiles, XLA's autotuning). sequences:
    the prompt as that many prompts of equal length, submitted together; TTFT until the last one's first token."""
    chunk = min(chunk, len(prompt))
    n = len(prompt) // sequences
    prompts = [prompt[i * n:(i + 1) * n] for i in range(sequences)]
    path, _, quantization = path.partition("+")
    ops, options = PATH_OPTIONS.get(path, (path, {}))
    if quantization:
        options = {**options, "quantization": quantization}
    t_start = time.perf_counter()
    engine = Engine(model_dir, dtype="bfloat16", ops=ops, **options, max_num_seqs=sequences, max_model_len=n + 16,
                    compile_all_at_start=True,
                    max_num_batched_tokens=chunk, token_buckets=[chunk], progress=False, skip_tokenizer_init=True, max_logprobs=0,
                    enable_prefix_caching=False, num_pages=sequences * -(-(n + 16) // 16) + 1,
                    tensor_parallel_size=tensor_parallel_size)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    best = float("inf")
    for i in range(repeats + 1):     # the first run is a warm-up
        t0 = time.perf_counter()
        rids = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        token = [engine.take_finished(r).outputs[0].token_ids[0] for r in rids][0]
        best = min(best, time.perf_counter() - t0)
        if i == 0:
            start_s = time.perf_counter() - t_start
    if profile_dir:  # one more prompt, traced: which kernels the time goes to
        from bench.trace_kernels import kernel_trace, print_summary, summarize

        with kernel_trace(profile_dir):
            rids = [engine.add_request(p, params) for p in prompts]
            while engine.has_unfinished():
                engine.step()
            for r in rids:
                engine.take_finished(r)
        print_summary(summarize(profile_dir, steps=1))
    del engine
    gc.collect()
    return best, token, start_s


def ttft_hf(model_dir: Path, prompt: list[int], repeats: int = 3) -> tuple[float, int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    t_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    best = float("inf")
    with torch.inference_mode():
        for i in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            token = int(model(input_ids=ids, logits_to_keep=1).logits[0, -1].argmax())
            best = min(best, time.perf_counter() - t0)
            if i == 0:
                start_s = time.perf_counter() - t_start
    del model
    torch.cuda.empty_cache()
    return best, token, start_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3-4b", "llama3-8b"])
    ap.add_argument("--prompts", type=int, nargs="+", default=[128, 1024, 8192, 32768])
    ap.add_argument("--paths", nargs="+", default=["pallas", "reference", "hf"],
                    help=f"ops names, hf (transformers), or {', '.join(PATH_OPTIONS)}")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (token budget of a step)")
    ap.add_argument("--profile", nargs="*", default=[], help="path:prompt cases to trace, e.g. pallas:1024")
    ap.add_argument("--quantization", nargs="*", default=[], choices=["int8", "fp8"],
                    help="run each of our paths again with its weights quantized at load (path+fp8)")
    ap.add_argument("--fp8-tables", default=None, metavar="JSON",
                    help="SKINNY_GEMM_8BIT rows and FP8_W8A8_ROWS from a quantized_gemv.py --fp8-rows run (A/B runs)")
    ap.add_argument("--hopper-8bit-table", default=None, metavar="JSON",
                    help="tables.HOPPER_GEMM_8BIT rows from a bench/kernels/hopper_gemm.py --w8a8 run's winners "
                         "(A/B runs: 8-bit weights' prompt rows in the Mosaic GEMM's W8A8)")
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="our paths over this many devices; the share is of N devices' GEMM rate (one device's x N); "
                         "hf paths are skipped")
    ap.add_argument("--sequences", type=int, default=1,
                    help="each prompt as this many prompts of equal length submitted together (our paths only)")
    args = ap.parse_args()
    if args.sequences < 1 or any(T % args.sequences for T in args.prompts):
        ap.error(f"--sequences {args.sequences} must divide every --prompts length {args.prompts}")
    tp = args.tensor_parallel_size
    hf_out = [why for why, on in ((f"tensor parallel size {tp} (one device; ours only)", tp > 1),
                                  (f"--sequences {args.sequences} (one prompt; ours only)", args.sequences > 1)) if on]
    if hf_out and any(p.startswith("hf") for p in args.paths):
        print(f"# {'; '.join(hf_out)}: skipping the transformers path(s) "
              f"{' '.join(p for p in args.paths if p.startswith('hf'))}", flush=True)
        args.paths = [p for p in args.paths if not p.startswith("hf")]
    if args.fp8_tables:
        from bench.kernels.fp8_rows import apply_tables

        print(f"# {apply_tables(args.fp8_tables)}", flush=True)
    if args.hopper_8bit_table and not Path(args.hopper_8bit_table).exists():   # its sweep ran out of time: say so
        print(f"# --hopper-8bit-table {args.hopper_8bit_table}: no such file; HOPPER_GEMM_8BIT stays empty", flush=True)
    elif args.hopper_8bit_table:
        from bench.kernels.hopper_gemm import patch_table_8bit

        patch_table_8bit(args.hopper_8bit_table)
    keep_command_buffers_when_profiling(bool(args.profile))   # before the first use of the GPU
    args.paths += [f"{p}+{q}" for q in args.quantization for p in args.paths if p != "hf"]
    gemm = dense_gemm_rate(8192 if jax.devices()[0].platform == "gpu" else 512)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; dense bf16 GEMM {gemm / 1e12:.0f} TFLOP/s "
          f"(one device); tensor parallel size {tp}: shares of {tp} x that")
    print("| shape | prompt | path | TTFT ms | prompt tok/s | TFLOP/s | share of GEMM rate | x bf16 | start s |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    # what the figures were measured on and with (written with every row)
    run = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, date=datetime.datetime.now().isoformat(),
               argv=sys.argv[1:], gemm=gemm, tensor_parallel_size=tp)
    rows = []
    save = lambda: Path(args.out, "prefill.json").write_text(json.dumps(dict(run, rows=rows), indent=1))
    for shape in args.shapes:
        model_dir = bench_model(args.models, shape)
        cfg = load_config(model_dir, "bfloat16")
        for T in args.prompts:
            prompt = np.random.default_rng(T).integers(100, cfg.vocab_size - 100, T).tolist()
            for path in args.paths:
                try:
                    s, token, start_s = ttft_hf(model_dir, prompt) if path == "hf" else ttft_jaxinfer(
                        model_dir, path, prompt, args.chunk,
                        profile_dir=f"/tmp/trace-prefill-{shape}-{T}-{path}" if f"{path}:{T}" in args.profile else None,
                        tensor_parallel_size=tp, sequences=args.sequences)
                except Exception as e:   # reported, not fatal to the table (e.g. out of memory)
                    print(f"| {shape} | {T} | {path} | failed: {type(e).__name__}: {str(e)[:80]} | | | | | |", flush=True)
                    rows.append(dict(shape=shape, prompt=T, path=path, error=str(e)[:300]))
                    continue
                flops = prefill_flops(cfg, T, args.sequences)
                row = dict(shape=shape, prompt=T, sequences=args.sequences, path=path, ttft_ms=1e3 * s, tok_s=T / s,
                           tflops=flops / s / 1e12, share=flops / s / (gemm * tp), first_token=token, start_s=start_s)
                base = [r for r in rows if (r["shape"], r["prompt"], r["path"]) == (shape, T, path.partition("+")[0])
                        and "ttft_ms" in r] if "+" in path else []
                if base:
                    row["speedup_vs_bf16"] = base[0]["ttft_ms"] / row["ttft_ms"]
                rows.append(row)
                speedup = f"{row['speedup_vs_bf16']:.2f}" if base else "-"
                print(f"| {shape} | {T} | {path} | {row['ttft_ms']:.1f} | {row['tok_s']:,.0f} | {row['tflops']:.0f} | "
                      f"{100 * row['share']:.1f}% | {speedup} | {start_s:.1f} |", flush=True)
                # after every row: a run cut off by its time limit keeps what it measured
                save()
    save()   # also a run with no rows


if __name__ == "__main__":
    main()
