"""Single-stream decode speed of stories260k on this machine's CPU.

    .venv/bin/python bench/cpu_decode.py [--model DIR] [--new-tokens 256] [--steps-per-dispatch 1 8 32]

Greedy, one request, 256 new tokens after warm-up (EOS ignored so every run decodes the same
number of tokens). For each number of decode steps per device dispatch, with and without reading
each dispatch back one dispatch late (the engine's overlap), it prints tok/s and the time per
dispatch, which separates the fixed cost of a dispatch (host work, launch) from the
per-token compute.
"""

from __future__ import annotations

import argparse
import platform

import jax

from jaxinfer.engine.engine import Engine
from jaxinfer.sampling import SamplingParams


def measure(model: str, new_tokens: int, steps: int, overlap: bool = True, repeats: int = 5) -> tuple[float, float]:
    engine = Engine(model, dtype="float32", ops="reference", max_num_seqs=1, decode_steps=steps,
                    max_num_batched_tokens=64, progress=False, overlap_decode=overlap, compile_all_at_start=True)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.add_request("Once upon a time", params)  # warm-up request: nothing left to compile after this
    while engine.has_unfinished():
        engine.step()
    best = 0.0
    dispatch = 0.0
    for _ in range(repeats):
        engine.stats = {k: 0 for k in engine.stats}
        rid = engine.add_request("Once upon a time", params)
        while engine.has_unfinished():
            engine.step()
        engine.take_finished(rid)
        s = engine.stats
        rate = s["decode_tokens"] / s["decode_seconds"]
        if rate > best:
            best, dispatch = rate, s["decode_seconds"] / -(-s["decode_tokens"] // steps)
    return best, dispatch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="../shared/models/stories260k")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps-per-dispatch", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    args = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {jax.devices()[0].platform}, jax {jax.__version__}")
    print("| decode steps per dispatch | read back one dispatch late | tok/s | ms per dispatch |")
    print("|---|---|---|---|")
    for steps in args.steps_per_dispatch:
        for overlap in (False, True):
            rate, per_dispatch = measure(args.model, args.new_tokens, steps, overlap)
            print(f"| {steps} | {'yes' if overlap else 'no'} | {rate:,.0f} tok/s | {per_dispatch * 1e3:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
