"""Host time of one prompt step with the server's shapes, on any backend (the CPU too): what a
1,024-token prompt costs the engine thread before its step is launched.

    PYTHONPATH=. python3 bench/host_prompt_step.py [--layers 2] [--max-num-seqs 64] [--max-model-len 40960]
    (env SORT=cumtime TOP=40: the profile's order and length; tottime, 12 by default)

A random Qwen3-0.6B-like model (hidden 64, the real vocabulary, `--layers` layers: the host work does
not depend on the width) in an engine with the server's batch shapes: a mixed step carries a page
table of max_num_seqs rows x max_model_len / 16 pages (64 x 2,560 int32 = 655 KB at the defaults),
and start_sequence uploads max_model_len token ids. Prints the median over 20 one-token requests of:
add_request; start_sequence (the sampler row's reset: only for requests with a penalty, see
--repetition-penalty); add_request to the mixed step's launch (all host work: scheduling, start_sequence,
building the batch, packing and copying it); the launch call;
the to_device calls (start_sequence's and the batch's) and the init_row call summed; then the functions
with the most own time (cProfile). JSON to $OUT/host_prompt_step.json.

On the CPU backend a jitted call may execute before it returns (start_sequence's 0.6-0.7 ms there is
mostly init_row running; its arguments' copy takes 0.06 ms): the split means most on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer.engine.engine import Engine
from bench.random_model import QWEN3_0_6B, write_random_model
from jaxinfer.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="not 1: the requests have a penalty, so their sampler row is reset (start_sequence)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default=None, help="where to write the random model (default: a temporary folder)")
    # The reference ops' prefill attention gathers each row's whole page span ([T, max_model_len, ...]); with the
    # server's 40,960 tokens a run on the H200 printed nothing within 60 s, likely that. The host work is the same.
    ap.add_argument("--ops", default="pallas" if jax.default_backend() == "gpu" else "reference")
    ap.add_argument("--fresh-prompt-attention", action="store_true",
                    help="the one-sequence prompt step (the GPU default) on any backend")
    args = ap.parse_args()
    cfg = {**QWEN3_0_6B, "hidden_size": 64, "num_hidden_layers": args.layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
           "max_position_embeddings": args.max_model_len}
    model = write_random_model(Path(args.models or tempfile.mkdtemp()) / "host-prompt-step", cfg, dtype="float32")
    engine = Engine(model, ops=args.ops, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                    max_num_batched_tokens=2048, token_buckets=[args.prompt, 2048], progress=False,
                    skip_tokenizer_init=True, num_pages=args.max_model_len // 16 + 8, enable_prefix_caching=False,
                    **({"fresh_prompt_attention": True} if args.fresh_prompt_attention else {}))
    prompt = np.random.default_rng(0).integers(100, 1000, args.prompt).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, repetition_penalty=args.repetition_penalty)

    def one() -> None:
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        engine.take_finished(rid)

    for _ in range(3):
        one()
    r, marks = engine.runner, {}
    launch_mixed, start_sequence = r.launch_mixed, r.start_sequence

    def timed_launch(*a, **k):
        marks["launch"] = time.perf_counter()
        out = launch_mixed(*a, **k)
        marks["launched"] = time.perf_counter()
        return out

    def timed_start(*a, **k):
        t = time.perf_counter()
        start_sequence(*a, **k)
        marks["start_sequence"] = time.perf_counter() - t

    r.launch_mixed, r.start_sequence = timed_launch, timed_start
    # the pieces: every to_device (pack, one copy; unpack's dispatch where the step does not split the batch
    # itself) and the init_row call, summed per request
    import jaxinfer.engine.engine as engine_mod
    import jaxinfer.runner.model_runner as runner_mod

    def summed(key, fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            marks[key] = marks.get(key, 0.0) + time.perf_counter() - t
            return out
        return wrapped

    to_device, to_device_packed = engine_mod.to_device, engine_mod.to_device_packed
    engine_mod.to_device = runner_mod.to_device = summed("to_device", to_device)
    engine_mod.to_device_packed = summed("to_device", to_device_packed)   # the prompt step's batch
    r._init_row = summed("init_row", r._init_row)
    rows, pieces = [], []
    for _ in range(20):
        for key in ("to_device", "init_row", "start_sequence"):   # (start_sequence: requests with a penalty only)
            marks[key] = 0.0
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, params)
        t1 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        engine.take_finished(rid)
        rows.append((t1 - t0, marks["start_sequence"], marks["launch"] - t0, marks["launched"] - marks["launch"]))
        pieces.append((marks["to_device"], marks["init_row"]))
    engine_mod.to_device = runner_mod.to_device = to_device
    engine_mod.to_device_packed = to_device_packed
    med = np.median(np.array(rows) * 1e3, axis=0)
    med_pieces = np.median(np.array(pieces) * 1e3, axis=0)
    print(f"page table {args.max_num_seqs} x {r.pages_per_seq} int32 ({args.max_num_seqs * r.pages_per_seq * 4 / 1e3:.0f} KB); "
          f"medians of 20, ms: add_request {med[0]:.3f}, start_sequence {med[1]:.3f}, "
          f"add_request to launch {med[2]:.3f}, launch {med[3]:.3f}; of these, to_device calls "
          f"{med_pieces[0]:.3f}, the init_row call {med_pieces[1]:.3f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(10):
        one()
    profile.disable()
    pstats.Stats(profile).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", "12")))
    Path(args.out, "host_prompt_step.json").write_text(json.dumps(dict(
        vars(args), pages_per_seq=r.pages_per_seq, add_request_ms=med[0], start_sequence_ms=med[1],
        add_request_to_launch_ms=med[2], launch_ms=med[3], to_device_ms=med_pieces[0], init_row_call_ms=med_pieces[1]),
        indent=1))


if __name__ == "__main__":
    main()
