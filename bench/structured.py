"""Structured output's cost: decode step time of B requests with a JSON schema each against B unconstrained ones,
in the same engine and run, and the host's mask time per step.

    PYTHONPATH=. python3 bench/structured.py [--shape qwen3-4b] [--batch 64] [--context 512] [--steps 64]
                                             [--temperature 0] [--tokenizer DIR] [--lazy-compile] [--out DIR]
    CPU smoke: PYTHONPATH=. python3 bench/structured.py --shape tiny --batch 2 --context 8 --steps 4 --lazy-compile

1. End to end: (wall(steps tokens) - wall(1 token)) / (steps - 1), as bench/throughput.py measures a decode step:
   unconstrained requests run the engine's multi-step decode dispatches; constrained ones one step a dispatch with
   the host's bitmask (engine/constraints.py). Every request i has a schema of its own (an object holding an array
   of at least `steps` integers under the key "k<i>"), so none can finish before max_tokens; both runs emit the
   same number of tokens (ignore_eos).
2. The host's mask time (llguidance filling the constrained rows' bitmasks, its threads) per decode step, and per row.
3. The device alone: back-to-back launches of the unconstrained decode dispatch and of the masked one-step dispatch
   (its bitmask that of the requests' first tokens), per step, nothing read back in between.
Random bf16 weights at real shapes with the Qwen3 tokenizer (--tokenizer: its folder; on the GPU machine carry it,
e.g. .carry/qwen3). "tiny" is bench.random_model's 2-layer Qwen3 with the real 151,936-token vocabulary. Prints
rows as it goes; writes structured.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import numpy as np

from bench.random_model import SHAPES, write_random_model
from bench.throughput import greedy_decode_batch
from jaxinfer.engine.engine import Engine
from jaxinfer.runner.variants import StepVariant
from jaxinfer.sampling import SamplingParams, StructuredOutput

SHAPES_152K = {**SHAPES, "tiny": {**SHAPES["tiny"], "vocab_size": 151936}}


def model_with_tokenizer(models_dir: str, shape: str, tokenizer_dir: str) -> Path:
    out = Path(models_dir) / f"{shape}-tokenizer"
    if not (out / "model.safetensors").is_file():
        t0 = time.perf_counter()
        write_random_model(out, SHAPES_152K[shape], dtype="bfloat16", seed=0, tokenizer_dir=tokenizer_dir)
        print(f"# wrote {shape} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def schema(i: int, steps: int) -> dict:
    """Request i's schema: an object holding an array of at least `steps` integers (so it outlasts max_tokens)."""
    items = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": steps}
    return {"type": "object", "properties": {f"k{i}": items}, "required": [f"k{i}"], "additionalProperties": False}


def run_all(engine: Engine, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0, [engine.take_finished(i) for i in ids]


def decode_step_ms(engine: Engine, prompts, params, steps: int) -> tuple[float, float, int, dict]:
    """(end-to-end decode step ms, host mask ms per decode step, tokens generated, the engine's phases (its
    phase_seconds: chain, collect) in ms per decode step): warm runs first (a masked step compiles on its first
    use)."""
    for n in (1, steps):
        run_all(engine, prompts, [dataclasses.replace(p, max_tokens=n) for p in params])
    c = engine.constraints
    m0 = c.mask_seconds
    one, _ = run_all(engine, prompts, [dataclasses.replace(p, max_tokens=1) for p in params])
    m1, p1 = c.mask_seconds, dict(engine.phase_seconds)
    full, outs = run_all(engine, prompts, params)
    mask_ms = 1e3 * ((c.mask_seconds - m1) - (m1 - m0)) / (steps - 1)
    phases = {k: 1e3 * (engine.phase_seconds[k] - p1[k]) / (steps - 1) for k in ("chain", "collect")}
    return 1e3 * (full - one) / (steps - 1), mask_ms, sum(len(o.outputs[0].token_ids) for o in outs), phases


def device_step_ms(engine: Engine, B: int, context: int, variant: StepVariant | None, bitmask,
                   dispatches: int = 4) -> float:
    """Back-to-back dispatches of `variant` over B greedy rows at `context` tokens, per decode step; with variant
    None, constrained steps (the forward pass, then the sampling under `bitmask`)."""
    steps = variant.steps if variant is not None else 1
    r = engine.runner
    per_seq = -(-(context + 2 * dispatches * steps + 1) // engine.config.page_size)
    pages = engine.pages.allocate(B * per_seq)
    try:
        batch = greedy_decode_batch(engine, B, context, pages, per_seq)

        def launch(b):
            if variant is not None:
                return r.launch_decode(b, variant)
            return r.launch_masked_sample(b, r.launch_masked_forward(b), bitmask, "greedy")

        jax.block_until_ready(launch(batch)[1])
        t0 = time.perf_counter()
        adv = batch
        for _ in range(dispatches):
            adv, outs = launch(adv)
        jax.block_until_ready(outs)
        return 1e3 * (time.perf_counter() - t0) / (dispatches * steps)
    finally:
        engine.pages.release(pages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--ops", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--lazy-compile", action="store_true", help="compile steps on first use (the warm runs), not at start")
    ap.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "qwen3"))
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    B, steps = args.batch, args.steps
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; {args.shape}, batch {B}, context {args.context}, "
          f"{steps} tokens, temperature {args.temperature}", flush=True)
    model = model_with_tokenizer(args.models, args.shape, args.tokenizer)
    t0 = time.perf_counter()
    # room for the device-only part too: 4 dispatches of up to decode_steps (8) steps, twice
    engine = Engine(model, dtype="bfloat16", ops=args.ops, max_num_seqs=B, max_model_len=args.context + max(steps, 64) + 16,
                    max_num_batched_tokens=2048, enable_prefix_caching=False, compile_all_at_start=not args.lazy_compile,
                    progress=False, max_logprobs=0)
    print(f"# engine start {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = engine.cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 100000, args.context).tolist() for _ in range(B)]
    free = [SamplingParams(max_tokens=steps, temperature=args.temperature, seed=i, ignore_eos=True) for i in range(B)]
    constrained = [dataclasses.replace(p, structured=StructuredOutput(json=schema(i, steps))) for i, p in enumerate(free)]
    out: dict = dict(device=jax.devices()[0].device_kind, shape=args.shape, batch=B, context=args.context, steps=steps,
                     temperature=args.temperature, vocab=vocab)

    print("\n## end to end: decode step ms ((wall(n tokens) - wall(1)) / (n - 1))")
    print("| requests | decode step ms | host mask ms / step | mask us / row | chain ms / step | collect ms / step "
          "| tokens |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for name, params in (("unconstrained", free), ("json schema each", constrained)):
        ms, mask_ms, tokens, phases = decode_step_ms(engine, prompts, params, steps)
        rows[name] = dict(step_ms=ms, mask_ms_per_step=mask_ms, tokens=tokens, phases_ms_per_step=phases)
        print(f"| {name} | {ms:.3f} | {mask_ms:.3f} | {1e3 * mask_ms / B:.1f} | {phases['chain']:.3f} | "
              f"{phases['collect']:.3f} | {tokens} |", flush=True)
    print("(chain: launching the next dispatch, a constrained step's forward pass; collect: the read-back, the tokens "
          "appended and, constrained, the masks and the sampling's launch)")
    ratio = rows["json schema each"]["step_ms"] / rows["unconstrained"]["step_ms"]
    print(f"\nconstrained / unconstrained decode step: {ratio:.3f}x", flush=True)
    out["end_to_end"], out["ratio"] = rows, ratio

    r = engine.runner
    matchers = [engine.constraints.matcher(p.structured) for p in constrained]
    bitmask = engine.constraints.bitmask(matchers + [None] * (r.batch_bucket(B) - B), r.batch_bucket(B))
    plain = r.decode_variant("greedy", r.batch_bucket(B))
    dev = dict(unconstrained=device_step_ms(engine, B, args.context, plain, None),
               masked=device_step_ms(engine, B, args.context, None, jax.device_put(bitmask)))
    print(f"\n## the device alone, per decode step: {plain.name} {dev['unconstrained']:.3f} ms, constrained (forward "
          f"pass, then sampling under the mask) {dev['masked']:.3f} ms ({dev['masked'] / dev['unconstrained']:.3f}x)",
          flush=True)
    out["device"] = dev
    Path(args.out, "structured.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
