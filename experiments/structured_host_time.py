"""Host time of a constrained decode step on the CPU, by part, with the device's work taken out: where the ~1 ms a
step that the H200 did not hide behind the device goes (bench/structured.py: 64 requests with a JSON schema each).

    PYTHONPATH=. python3 experiments/structured_host_time.py [--batch 64] [--context 64] [--steps 32] [--ab]
                                                            [--profile] [--tokenizer DIR]

bench/structured.py's "tiny" model (2 layers, Qwen3's 151,936-token vocabulary and tokenizer) and its schemas, one
request each. The prompt steps run on the CPU; then the device is faked: the forward pass does nothing and the
sampling draws each row's token on the host among those its bitmask allows (timed apart), its outputs numpy arrays,
so what is timed is the engine's own host work (the real launches' host cost is the GPU's to measure; on this 2-core
machine XLA:CPU's threads would also compete with llguidance's). Prints ms a constrained decode step (the steps after
every request's first token; the least of --runs, each part): the parts of Engine.step in the order the host runs
them. --ab alternates runs with the host path as it was before 2026-12-04 (a same-process A/B); --profile prints the
top of a cProfile of the same steps by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import numpy as np

from bench.structured import model_with_tokenizer, schema
from jaxinfer.engine.engine import Engine
from jaxinfer.sampling import SamplingParams, StructuredOutput

TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "qwen3"
PARTS = ("forward launch", "chain rest", "fetch", "append", "mask", "sample launch", "step rest", "outside step")


def old_collect_decode(self: Engine, seqs, outs):
    """Engine._collect_decode before 2026-12-04 (--ab's before)."""
    tokens, logprobs, emitted, top_v, top_i = self.runner.fetch(outs)
    self.stats["decode_seconds"] += time.perf_counter() - self._decode_started
    self._decode_started = time.perf_counter()
    deltas = []
    for b, seq in enumerate(seqs):
        steps = np.nonzero(emitted[:, b])[0]
        if seq.finish_reason is not None:
            continue
        self.stats["decode_tokens"] += len(steps)
        seq.num_computed += len(steps)
        deltas.append(self._append(seq, tokens[steps, b], logprobs[steps, b], top_v[steps, b], top_i[steps, b]))
        if seq.finish_reason is not None:
            self._finished[seq.request_id] = seq
    return deltas


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--tokenizer", default=str(TOKENIZER),
                    help="Qwen3's tokenizer folder (on the GPU machine: .carry/qwen3)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ab", action="store_true", help="alternate runs with the host path before 2026-12-04 (per-row "
                    "numpy indexing in _collect_decode, a new bitmask every step): a same-process A/B")
    args = ap.parse_args()
    B = args.batch
    model = model_with_tokenizer(args.models, "tiny", args.tokenizer)
    e = Engine(model, dtype="bfloat16", max_num_seqs=B, max_model_len=args.context + args.steps + 16,
               max_num_batched_tokens=max(2048, B * args.context), enable_prefix_caching=False,
               compile_all_at_start=False, progress=False, max_logprobs=0, cache_dir="")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 100000, args.context).tolist() for _ in range(B)]
    params = [SamplingParams(max_tokens=args.steps, temperature=0.0, seed=i, ignore_eos=True,
                             structured=StructuredOutput(json=schema(i, args.steps))) for i in range(B)]

    spent = dict.fromkeys(PARTS + ("device",), 0.0)
    r = e.runner
    sample_rng = np.random.default_rng(1)

    def timed(name, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        return call

    # The device, faked for the decode loop: the forward pass is nothing; the sampling draws each row's token on the
    # host among those its bitmask allows (timed apart as "device"), returning numpy arrays as the outputs.
    def fake_forward(batch):
        return None

    def fake_sample(batch, logits, bitmask, sampler):
        t0 = time.perf_counter()
        rows = bitmask.shape[0]
        tokens = np.zeros((1, rows), np.int32)
        for b in range(rows):
            words = np.nonzero(bitmask[b])[0]
            w = int(words[sample_rng.integers(len(words))])
            bits = [j for j in range(32) if (int(bitmask[b, w]) >> j) & 1]
            tokens[0, b] = 32 * w + bits[sample_rng.integers(len(bits))]
        outs = (tokens, np.zeros((1, rows), np.float32), np.ones((1, rows), bool), np.zeros((1, rows, 0), np.float32),
                np.zeros((1, rows, 0), np.int32))
        spent["device"] += time.perf_counter() - t0
        return batch, outs

    real = dict(launch_masked_forward=r.launch_masked_forward, launch_masked_sample=r.launch_masked_sample,
                fetch=r.fetch)
    fake = dict(launch_masked_forward=timed("forward launch", fake_forward),
                launch_masked_sample=timed("sample launch", fake_sample),
                fetch=timed("fetch", lambda outs: tuple(outs)))
    bitmask = timed("mask", e.constraints.bitmask)
    new_collect = e._collect_decode
    before_mode = [False]
    e.constraints.bitmask = lambda m, rows, reuse=False: bitmask(m, rows, reuse and not before_mode[0])
    e._collect_decode = lambda seqs, outs: (old_collect_decode(e, seqs, outs) if before_mode[0] else
                                            new_collect(seqs, outs))
    e._chain = timed("chain", e._chain)
    e._collect_decode = timed("collect", e._collect_decode)
    e.step = timed("step", e.step)
    spent.update(chain=0.0, collect=0.0, step=0.0)
    profile = cProfile.Profile() if args.profile else None
    runs = {False: [], True: []}
    for run in range(args.runs * (1 + args.ab) + 1):   # the first compiles
        before_mode[0] = args.ab and run % 2 == 1
        vars(r).update(real)
        ids = [e.add_request(p, sp) for p, sp in zip(prompts, params)]
        while any(len(s.output_ids) == 0 for s in e.scheduler.running) or e.scheduler.waiting:   # prompts
            e.step()
        vars(r).update(fake)
        before, n0 = dict(spent), sum(len(s.output_ids) for s in e.scheduler.running)
        t_out, steps = time.perf_counter(), 0
        if profile and run:
            profile.enable()
        while e.has_unfinished():
            spent["outside step"] += time.perf_counter() - t_out
            e.step()
            t_out = time.perf_counter()
            steps += 1
        if profile and run:
            profile.disable()
        outs = [e.take_finished(i) for i in ids]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs) - n0
        d = {k: v - before[k] for k, v in spent.items()}
        d["chain rest"] = d["chain"] - d["forward launch"]
        d["sample launch"] -= d["device"]
        d["step rest"] = d["step"] - d["chain"] - d["collect"] - d["mask"] - d["sample launch"] - d["device"]
        d["append"] = d["collect"] - d["fetch"]
        if run:
            runs[before_mode[0]].append({k: 1e3 * v / (tokens / B) for k, v in d.items()})
        print(f"# run {run}{' (before)' if before_mode[0] else ''}: {steps} engine steps, {tokens} tokens after the "
              f"first ({tokens / B:.1f} a request)", flush=True)
    modes = (True, False) if args.ab else (False,)
    print(f"\n## host ms a constrained decode step, batch {B} (the least of {args.runs} runs, each part; the device's "
          f"work apart)")
    print("| part |" + "".join(" before | after |" if args.ab else " ms / step |"))
    print("|---|" + "---|" * len(modes))
    least = {m: {k: min(r_[k] for r_ in runs[m]) for k in PARTS + ("device",)} for m in modes}
    for k in PARTS:
        print(f"| {k} |" + "".join(f" {least[m][k]:.3f} |" for m in modes))
    print("| **host, all** |" + "".join(f" **{sum(least[m][k] for k in PARTS):.3f}** |" for m in modes))
    print("| (fake device: the host's draw under the mask, apart) |" +
          "".join(f" {least[m]['device']:.3f} |" for m in modes))
    c = e.constraints
    print(f"\nmask rows: {c.masks}; mask ms a row: {1e3 * c.mask_seconds / c.masks:.4f}")
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
