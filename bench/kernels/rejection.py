"""Speculative verify's acceptance (jaxinfer.sampling.rejection.verify) per call over the vocabulary, beside
`sample` on the same number of rows: what a verify step adds to a decode step's sampling.

    PYTHONPATH=. python3 bench/kernels/rejection.py [--vocab 151936] [--shapes 8x4 64x4 64x8 128x8] [--calls 8]

Shapes are B x Q (sequences x rows a sequence: Q - 1 drafts, all counted), on [B, Q, V] float32 logits with
the penalty inputs the engine passes (prompt mask, output counts); drafts are the rows' argmax (so most are
accepted and every row's distribution is used). Variants:
- greedy_only: the argmax path (all-greedy batches);
- branch, greedy rows: the sampling path on greedy rows (the conditional skips the sort);
- plain, temperature 0.8: no sort (min-p threshold, Gumbel noise by token id), one-hot drafts;
- plain + draft_probs: the same with a draft distribution q [B, Q-1, V] (the uniform, p, the residual);
- filter, top-k 20 / top-p 0.95: the filters on the 64 largest logits;
- sort, top-k 20 / top-p 0.95: the full sort over the vocabulary;
- sample, same rows: `sample` (method "filter", top-k 20 / top-p 0.95) on B*Q rows, for scale.
Each jit runs a variant on `calls` different inputs in a row; best of 3, ms per call; "temp MB": XLA's
temporary buffers for one call of the "plain + draft_probs" variant (compiled memory analysis). The filter
variant must commit the sort's tokens (checked; exit 1 if not). JSON to $OUT/rejection.json.
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
from jaxinfer.sampling.rejection import verify
from jaxinfer.sampling.sample import SamplingArrays, sample


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--shapes", nargs="*", default=["8x4", "64x4", "64x8", "128x8"])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    V = args.vocab

    greedy, sampled, filtered = dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.6, top_k=20, top_p=0.95)
    variants = {
        "greedy_only": (greedy, False, dict(greedy_only=True)),
        "branch, greedy rows": (greedy, False, {}),
        "plain, temperature 0.8": (sampled, False, dict(method="plain")),
        "plain + draft_probs": (sampled, True, dict(method="plain")),
        "filter, top-k 20 / top-p 0.95": (filtered, False, dict(method="filter")),
        "sort, top-k 20 / top-p 0.95": (filtered, False, dict(method="sort")),
    }
    rows = []
    for shape in args.shapes:
        B, Q = (int(x) for x in shape.split("x"))
        xs = [jax.random.normal(jax.random.PRNGKey(i), (B, Q, V)) * 3 for i in range(args.calls)]
        drafts = [jnp.argmax(x[:, :-1], axis=-1).astype(jnp.int32) for x in xs]
        q = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(99), (B, Q - 1, V)) * 3, axis=-1)
        nd = jnp.full((B,), Q - 1, jnp.int32)
        pm = jnp.zeros((B, V), bool).at[:, :64].set(True)
        oc = jnp.zeros((B, V), jnp.int32)
        step = jnp.zeros(B, jnp.int32)
        row, tokens = dict(shape=shape, rows=B * Q), {}
        for name, (params, with_q, kw) in variants.items():
            a = SamplingArrays.from_params([SamplingParams(**params)] * B, list(range(B)), B)
            dp = q if with_q else None

            def f(xs, a, dp=dp, kw=kw):
                return [verify(x, d, nd, a, step + 7 * i, pm, oc, dp, **kw)[1] for i, (x, d) in enumerate(zip(xs, drafts))]

            out, row[name] = best_ms_per_call(jax.jit(f), (xs, a), args.calls)
            tokens[name] = np.stack(out)
            if with_q:
                one = jax.jit(lambda x, d, a: verify(x, d, nd, a, step, pm, oc, q, **kw))
                mem = one.lower(xs[0], drafts[0], a).compile().memory_analysis()
                row["temp MB"] = (mem.temp_size_in_bytes / 2**20) if mem is not None else float("nan")
        a = SamplingArrays.from_params([SamplingParams(**filtered)] * (B * Q), list(range(B * Q)), B * Q)
        flat_pm, flat_oc, flat_step = jnp.repeat(pm, Q, axis=0), jnp.repeat(oc, Q, axis=0), jnp.zeros(B * Q, jnp.int32)
        f = jax.jit(lambda xs, a: [sample(x.reshape(B * Q, V), a, flat_step, flat_pm, flat_oc, method="filter")[0]
                                   for x in xs])
        _, row["sample, same rows"] = best_ms_per_call(f, (xs, a), args.calls)
        row["equal"] = bool(np.array_equal(tokens["filter, top-k 20 / top-p 0.95"], tokens["sort, top-k 20 / top-p 0.95"]))
        rows.append(row)
        print("# " + json.dumps(row), flush=True)
    names = list(variants) + ["sample, same rows"]
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, vocab {V}; ms per call")
    print_table(rows, [("B x Q", "shape", ""), ("rows", "rows", "")] + [(f"{n} ms", n, ".3f") for n in names] +
                [("temp MB", "temp MB", ".0f"), ("filter = sort", "equal", "")])
    Path(args.out, "rejection.json").write_text(json.dumps(rows, indent=1))
    if not all(r["equal"] for r in rows):
        raise SystemExit("the filter method committed other tokens than the sort")


if __name__ == "__main__":
    main()
