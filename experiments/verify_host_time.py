"""Host time of a verify step outside its launch and read-back, on the CPU (stories260k, batch 1, n-gram drafts on a
copy-heavy prompt, every draft verified).

    PYTHONPATH=. python3 experiments/verify_host_time.py [--steps 400] [--batch 1] [--profile]

Times, per verify step, the engine's `_drafts` (proposals, pages held) and `_verify` (arrays built, copied, the
accepted tokens appended) less the runner's launch and fetch, which are the device's share; prints us a step (the
median of the runs) and with --profile the top of a cProfile of the same run by own time (launch and fetch
included there).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine import verify_steps
from jaxinfer.sampling.sample import SamplingArrays

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400, help="verify steps timed (about)")
    ap.add_argument("--batch", type=int, default=1, help="copies of the prompt at once")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    llm = LLM(STORIES, speculative="ngram", num_speculative_tokens=7, max_num_seqs=args.batch, chain_verify=False,
              enable_prefix_caching=False, progress=False, cache_dir="")
    e = llm.engine
    e.speculator.adaptive = False   # every proposal verified
    story = llm.generate("Once upon a time", SamplingParams(max_tokens=160, temperature=0))[0]
    ids = story.prompt_token_ids + story.outputs[0].token_ids
    prompt = ids + ids[:24]   # it retells the story: the n-gram proposals hold
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    llm.generate([prompt] * args.batch, params)   # compiles every step shape

    spent = dict(drafts=0.0, verify=0.0, launch=0.0, fetch=0.0, append=0.0, copy=0.0, sampling=0.0)
    r = e.runner

    def timed(name, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        return call
    inside = [False]   # within _verify: its fetch is the verify step's

    def verify(*a, **kw):
        inside[0] = True
        try:
            return timed("verify", verify_step)(*a, **kw)
        finally:
            inside[0] = False
    verify_step, fetch = e._verify, r.fetch
    e._drafts, e._verify = timed("drafts", e._drafts), verify
    r.launch_verify = timed("launch", r.launch_verify)
    r.fetch = lambda outs: timed("fetch", fetch)(outs) if inside[0] else fetch(outs)
    # parts of the host's share: the copy to the device, the sampling arrays, the tokens appended
    append, copy, sampling = e._append, verify_steps.to_device_packed, SamplingArrays.from_params
    e._append = lambda *a: timed("append", append)(*a) if inside[0] else append(*a)
    verify_steps.to_device_packed = timed("copy", copy)
    verify_steps.SamplingArrays = type("Timed", (), dict(from_params=staticmethod(timed("sampling", sampling))))
    profile = cProfile.Profile() if args.profile else None
    runs = []   # (verify steps, spent) of each generate call: the median run is reported (the CPU is shared)
    while sum(n for n, _ in runs) < args.steps:
        before, spent_before = e.speculator.stats.verify_steps, dict(spent)
        if profile:
            profile.enable()
        llm.generate([prompt] * args.batch, params)
        if profile:
            profile.disable()
        runs.append((e.speculator.stats.verify_steps - before, {k: v - spent_before[k] for k, v in spent.items()}))
    per_run = [{k: 1e6 * v / n for k, v in sp.items()} for n, sp in runs]
    for p in per_run:
        p["host"] = p["drafts"] + p["verify"] - p["launch"] - p["fetch"]
        p["arrays"] = p["verify"] - p["launch"] - p["fetch"] - p["append"] - p["copy"] - p["sampling"]
    per = sorted(per_run, key=lambda p: p["host"])[len(per_run) // 2]
    st = e.speculator.stats
    print(f"{sum(n for n, _ in runs)} verify steps in {len(runs)} runs, {st.mean_accepted_length:.2f} tokens a "
          f"sequence's verify; the median run's launch {per['launch']:.0f} us a step, fetch {per['fetch']:.0f}")
    print("| host, us a verify step | drafts | arrays (rest of _verify) | sampling arrays | copy to device | append | "
          "all |\n|---|---|---|---|---|---|---|")
    print(f"| stories260k, batch {args.batch}, k = 7 | {per['drafts']:.0f} | {per['arrays']:.0f} | "
          f"{per['sampling']:.0f} | {per['copy']:.0f} | {per['append']:.0f} | {per['host']:.0f} |")
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
