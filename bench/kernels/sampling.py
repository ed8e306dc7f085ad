"""The sampler's cost per call over the vocabulary: where a sampling step's time goes.

    PYTHONPATH=. python3 bench/kernels/sampling.py [--vocab 151936] [--rows 1 8 64] [--calls 16]

Variants of jaxinfer.sampling.sampling.sample on [B, V] float32 logits with the penalty inputs the engine
passes (prompt mask, output counts):
- argmax: greedy_only=True (what all-greedy batches run);
- branch, greedy rows: the sampling variant on greedy rows (the conditional skips the sort; on a GPU
  the runtime reads its predicate back mid-call);
- branch, temperature 0.8: the same with sampled rows (the sort over the vocabulary runs);
- sort, no branch: method "sort" with sampled rows (the sort always, no conditional);
- plain, no sort: method "plain" with sampled rows (what plain_sampling_step runs when no row has
  top-k or top-p: min-p as a threshold, Gumbel noise by token id);
- sort, top-k 20 / top-p 0.95: method "sort" on rows with Qwen3's recommended filters;
- filter, no sort: method "filter" on the same rows (the filters on the 64 largest logits);
- sort, top-p 0.9: method "sort" on rows with top-p alone (Llama 3's recommended, with temperature 0.6);
- filter-p, top-k 20 / top-p 0.95: method "filter-p" on the top-k rows (what the radix search for rows
  with top-p alone adds to a step that has them);
- filter-p, top-p 0.9: method "filter-p" on the same rows (the nucleus's boundary by a radix search);
- part, top-64 by blocks / part, top-p search: the filters' two large parts alone (`top_k_by_blocks` at
  k = 64 on the logits; `_top_p_keep` at top-p 0.9 on the tempered logits), to split the filters' time.
Each jit runs the variant on `calls` different inputs in a row; best of 3, ms per call. The samplers
without the sort must draw the tokens of the sorting one on the same rows (checked; exit 1 if not).
JSON to $OUT/sampling.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels.kernel_timing import best_ms_per_call
from bench.table import print_table
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.sample import TOP_K_CANDIDATES, SamplingArrays, _top_p_keep, sample, top_k_by_blocks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    V = args.vocab

    def arrays(B, params):
        return SamplingArrays.from_params([SamplingParams(**params)] * B, list(range(B)), B)

    greedy, sampled, filtered = dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.6, top_k=20, top_p=0.95)
    nucleus = dict(temperature=0.6, top_p=0.9)
    variants = {
        "argmax": (greedy, lambda *x: sample(*x, greedy_only=True)),
        "branch, greedy rows": (greedy, lambda *x: sample(*x)),
        "branch, temperature 0.8": (sampled, lambda *x: sample(*x)),
        "sort, no branch": (sampled, lambda *x: sample(*x, method="sort")),
        "plain, no sort": (sampled, lambda *x: sample(*x, method="plain")),
        "sort, top-k 20 / top-p 0.95": (filtered, lambda *x: sample(*x, method="sort")),
        "filter, top-k 20 / top-p 0.95": (filtered, lambda *x: sample(*x, method="filter")),
        "sort, top-p 0.9": (nucleus, lambda *x: sample(*x, method="sort")),
        "filter-p, top-k 20 / top-p 0.95": (filtered, lambda *x: sample(*x, method="filter-p")),
        "filter-p, top-p 0.9": (nucleus, lambda *x: sample(*x, method="filter-p")),
        "part, top-64 by blocks": (nucleus, lambda x, *_: (top_k_by_blocks(x, TOP_K_CANDIDATES)[1],)),
        "part, top-p search": (nucleus, lambda x, a, *_: (_top_p_keep((x - x.max(-1, keepdims=True)) / 0.6,
                                                                      a.top_p),)),
    }
    rows = []
    SAME_TOKENS = [("sort, no branch", "plain, no sort"), ("branch, temperature 0.8", "plain, no sort"),
                   ("sort, top-k 20 / top-p 0.95", "filter, top-k 20 / top-p 0.95"),
                   ("sort, top-k 20 / top-p 0.95", "filter-p, top-k 20 / top-p 0.95"),
                   ("sort, top-p 0.9", "filter-p, top-p 0.9")]
    for B in args.rows:
        xs = [jax.random.normal(jax.random.PRNGKey(i), (B, V)) * 3 for i in range(args.calls)]
        pm = jnp.zeros((B, V), bool).at[:, :64].set(True)
        oc = jnp.zeros((B, V), jnp.int32)
        step = jnp.zeros(B, jnp.int32)
        row, tokens = dict(rows=B), {}
        for name, (params, op) in variants.items():
            a = arrays(B, params)
            f = jax.jit(lambda xs, a, op=op: [op(x, a, step, pm, oc)[0] for x in xs])
            out, row[name] = best_ms_per_call(f, (xs, a), args.calls)
            tokens[name] = np.stack(out)
        # the samplers without the sort must draw the sorting one's tokens (same seeds, same rows)
        row["equal"] = all(np.array_equal(tokens[a], tokens[b]) for a, b in SAME_TOKENS)
        rows.append(row)
        print("# " + json.dumps(row), flush=True)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, vocab {V}; ms per call")
    print_table(rows, [("rows", "rows", "")] + [(f"{n} ms", n, ".3f") for n in variants] +
                [("tokens equal", "equal", "")])
    Path(args.out, "sampling.json").write_text(json.dumps(rows, indent=1))
    if not all(r["equal"] for r in rows):
        raise SystemExit("a sampler without the sort drew other tokens than the sorting one")


if __name__ == "__main__":
    main()
