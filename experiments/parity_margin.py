"""Where the Pallas path's greedy tokens part from the reference path's, how close was the call?

For each cache dtype: both paths generate greedily with the top-2 logprobs; prints the first position where
the tokens differ, the top-2 margin (nats) of each path there, and the largest difference of the chosen
token's logprob over the positions before it (the paths' numerical noise). A parting at a margin of the
order of that noise is a near tie, not a wrong kernel.

Usage (GPU): PYTHONPATH=. python3 bench/parity_margin.py [--tokens 128] [--kv auto fp8]
"""

import argparse
import gc
import tempfile
from pathlib import Path

from jaxinfer.engine.engine import LLM
from bench.random_model import QWEN3_0_6B, write_random_model
from jaxinfer.sampling import SamplingParams

QWEN3_SMALL = {**QWEN3_0_6B, "num_hidden_layers": 4, "max_position_embeddings": 1024}


def generate(model_dir, ops, prompt, n, kv, logprobs=2, **extra):
    llm = LLM(model_dir, dtype="float32", ops=ops, max_num_seqs=2, max_model_len=512, max_num_batched_tokens=128,
              progress=False, skip_tokenizer_init=True, num_pages=2 * 512 // 16 + 1, kv_cache_dtype=kv, **extra)
    out = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs))[0]
    del llm
    gc.collect()
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.outputs[0].top_logprobs


def margin(top):
    values = sorted((v for _, v in top), reverse=True)
    return values[0] - values[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv", nargs="+", default=["auto", "fp8"])
    ap.add_argument("--greedy-kv", nargs="*", default=["fp8"], help="cache dtypes of the greedy-only runs")
    ap.add_argument("--ops", default="pallas", help="the kernels' path (pallas-interpret on the CPU)")
    ap.add_argument("--models", nargs="+", default=["stories", "qwen3"])
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    stories = next(p for p in (repo / ".carry" / "stories260k", repo.parent / "shared" / "models" / "stories260k")
                   if p.is_dir())
    qwen3 = None if "qwen3" not in args.models else write_random_model(Path(tempfile.mkdtemp()) / "qwen3", QWEN3_SMALL, dtype="float32", std=0.05)
    models = {"stories": (stories, [1, 403, 407, 261, 378]), "qwen3": (qwen3, list(range(1000, 1040)))}
    models = {k: v for k, v in models.items() if k in args.models}
    print("model    kv    parts at  margin ref  margin pallas  max |d logprob| before  min margin before")
    for name, (path, prompt) in models.items():
        for kv in args.kv:
            ref = generate(path, "reference", prompt, args.tokens, kv)
            pal = generate(path, args.ops, prompt, args.tokens, kv)
            d = next((i for i, (a, b) in enumerate(zip(ref[0], pal[0])) if a != b), None)
            upto = len(ref[0]) if d is None else d
            noise = max((abs(a - b) for a, b in zip(ref[1][:upto], pal[1][:upto])), default=0.0)
            least = min((margin(t) for t in ref[2][:upto]), default=float("nan"))
            at = "-" if d is None else str(d)
            mr = "-" if d is None else f"{margin(ref[2][d]):.2e}"
            mp = "-" if d is None else f"{margin(pal[2][d]):.2e}"
            print(f"{name:8s} {kv:5s} {at:>8s}  {mr:>10s}  {mp:>13s}  {noise:22.2e}  {least:17.2e}", flush=True)
    # Without logprobs (the greedy-only steps, as the parity tests run): where each path parts from the
    # reference with the greedy-only prompt step on, and whether that step changes a path's tokens.
    print("model    kv    ops               greedy_mixed_step  parts from reference (on) at")
    for name, (path, prompt) in models.items():
        for kv in args.greedy_kv:
            runs = {(ops, g): generate(path, ops, prompt, args.tokens, kv, None, greedy_mixed_step=g)[0]
                    for ops in ("reference", args.ops) for g in (True, False)}
            for (ops, g), tokens in runs.items():
                d = next((i for i, (a, b) in enumerate(zip(runs["reference", True], tokens)) if a != b), "-")
                print(f"{name:8s} {kv:5s} {ops:17s} {str(g):17s}  {d}", flush=True)


if __name__ == "__main__":
    main()
