"""A layer's four GEMVs, L layers, as one persistent Pallas Triton kernel (pallas/persistent_gemv.py) against the
engine's chain of fused_gemv kernels (four a layer), at Qwen3-4B's and Qwen3-0.6B's batch-1 shapes.

    PYTHONPATH=. python3 bench/kernels_persistent_gemv.py [--shapes qwen3-4b qwen3-0.6b] [--out DIR]
    PYTHONPATH=. python3 bench/kernels_persistent_gemv.py --interpret      (CPU dry run, tiny shapes)

Every layer reads its own weights (distinct matrices, so nothing stays in L2). Prints us a layer, the share of the
HBM read ceiling measured in the same run, each variant's output after two layers against the fused_gemv chain's
(relative error: the same roundings, sums in another order) and whether any CTA's barrier timed out. "no barrier"
rows skip the meetings on purpose (wrong sums): the loop's own streaming time.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernel_timing import best_ms_per_call
from jaxinfer.pallas import persistent_gemv as PG
from jaxinfer.pallas.fused_gemv import block_in_for, fused_gemv, rows_for

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

# (d, QKV rows, MLP width, layers, [(name, persistent_chain kwargs, rows a tile per product)])
SHAPES = {
    "qwen3-4b": (2560, 6144, 9728, 8),
    "qwen3-0.6b": (1024, 4096, 3072, 16),
    "tiny": (64, 128, 64, 2),
}
Q = 1 << 16   # polls before a barrier gives up: a meeting takes ~10-100 polls; a launch whose CTAs are not all
              # resident then fails in well under a second a barrier (its row says so) instead of stalling the run
VARIANTS = {   # name -> (rows a tile per product, persistent_chain kwargs); riskier residency last
    "qwen3-4b": [
        ("static P264 w4 d1", (2, 1, 1, 1), dict(programs=264, num_warps=4)),
        ("static P132 w4 d0 stages 3", (4, 2, 2, 1), dict(programs=132, num_warps=4, prefetch=0, num_stages=3)),
        ("static P132 w4 d0 stages 3 no barrier", (4, 2, 2, 1),
         dict(programs=132, num_warps=4, prefetch=0, num_stages=3, barriers=False)),
        ("static P132 w8 d0 stages 3", (4, 2, 2, 1), dict(programs=132, num_warps=8, prefetch=0, num_stages=3)),
        ("static P132 w4 d0 stages 4", (4, 2, 2, 1), dict(programs=132, num_warps=4, prefetch=0, num_stages=4)),
        ("static P264 w4 d0 stages 3", (2, 1, 1, 1), dict(programs=264, num_warps=4, prefetch=0, num_stages=3)),
        ("static P132 w4 d0 stages 3 bk256", (4, 2, 2, 1),
         dict(programs=132, num_warps=4, prefetch=0, num_stages=3, block_k=256)),
    ],
    "qwen3-0.6b": [
        ("static P264 w4 d2", (4, 1, 2, 1), dict(programs=264, num_warps=4, prefetch=2)),
        ("static P132 w4 d0 stages 3", (4, 1, 2, 1), dict(programs=132, num_warps=4, prefetch=0, num_stages=3)),
        ("static P264 w4 d0 stages 3", (4, 1, 2, 1), dict(programs=264, num_warps=4, prefetch=0, num_stages=3)),
    ],
    "tiny": [
        ("static P1", (4, 2, 2, 1), dict(programs=1, num_warps=4, block_k=32)),
        ("static P1 d2", (4, 2, 2, 1), dict(programs=1, num_warps=4, block_k=32, prefetch=2)),
        ("static P1 x from L1", (4, 2, 2, 1), dict(programs=1, num_warps=4, block_k=32, x_in_registers=False)),
        ("tickets P1", (4, 2, 2, 1), dict(programs=1, num_warps=4, block_k=32, schedule="tickets")),
    ],
}


def make_weights(d: int, q: int, inter: int, layers: int, seed: int = 0) -> tuple[jax.Array, ...]:
    key = jax.random.PRNGKey(seed)
    shapes = [(q, d), (d, q), (2 * inter, d), (d, inter)]
    return tuple((jax.random.normal(jax.random.fold_in(key, j), (layers, n, k), jnp.float32) / np.sqrt(k))
                 .astype(jnp.bfloat16) for j, (n, k) in enumerate(shapes))


def fused_gemv_chain(x, weights, *, interpret: bool = False):
    """The engine's way: four fused_gemv kernels a layer (its block_in and rows per shape), no norms."""
    s = x[None]
    for l in range(weights[0].shape[0]):
        def mv(v, w, ep, res=None):
            out = w.shape[1] // 2 if ep == "swiglu" else w.shape[1]
            return fused_gemv(v, w, l, residual=res, epilogue=ep, block_in=block_in_for(out, w.shape[2], w.dtype),
                              rows=rows_for(out, w.shape[2]), interpret=interpret)
        w0, w1, w2, w3 = weights
        q = mv(s, w0, "none")
        a = mv(q, w1, "residual", s)
        h = mv(a, w2, "swiglu")
        s = mv(h, w3, "residual", a)
    return s[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3-4b", "qwen3-0.6b"])
    ap.add_argument("--interpret", action="store_true", help="CPU dry run at tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = ["tiny"] if args.interpret else args.shapes
    ceiling = None
    if not args.interpret:
        from bench.ceilings import hbm_read_ceiling

        ceiling = hbm_read_ceiling()
        print(f"# HBM read ceiling {ceiling / 1e12:.2f} TB/s", flush=True)
    target_s = None if args.interpret else 0.3
    results = []
    for shape in shapes:
        d, q, inter, layers = SHAPES[shape]
        weights = make_weights(d, q, inter, layers)
        two = tuple(w[:2] for w in weights)
        layer_bytes = sum(w[0].size * w.dtype.itemsize for w in weights)
        x = jax.random.normal(jax.random.PRNGKey(1), (d,), jnp.float32).astype(jnp.bfloat16)
        print(f"\n## {shape}: {layers} layers of {layer_bytes / 1e6:.1f} MB "
              f"({1e6 * layer_bytes / ceiling:.2f} us a layer at the ceiling)" if ceiling else f"\n## {shape}", flush=True)
        print("| variant | us a layer | share of the read ceiling | rel err after 2 layers | timed out |")
        print("|---|---|---|---|---|")
        base = jax.jit(lambda x, w: fused_gemv_chain(x, w, interpret=args.interpret))
        want = np.asarray(base(x, two), np.float32)
        runs = [("fused_gemv chain (4 kernels a layer)", base)]
        for name, rows, kw in VARIANTS[shape]:
            prods = PG.layer_products(d, q, inter, rows)
            runs.append((name, jax.jit(lambda x, w, prods=prods, kw=kw: PG.persistent_chain(
                x, w, products=prods, interpret=args.interpret, **{"max_polls": Q, **kw}))))
        for name, f in runs:
            try:
                out, ms = best_ms_per_call(f, (x, weights), calls=layers, target_s=target_s)
                y2 = f(x, two)
            except Exception as e:   # a config that does not compile (registers, shared memory) is a row, not a stop
                print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |", flush=True)
                results.append(dict(shape=shape, variant=name, error=str(e)[:500]))
                continue
            timed_out = 0
            if isinstance(y2, tuple):
                y2, err2 = y2
                timed_out = int(np.count_nonzero(np.asarray(err2))) + int(np.count_nonzero(np.asarray(out[1])))
            y2 = np.asarray(y2, np.float32)
            rel = float(np.linalg.norm(y2 - want) / max(np.linalg.norm(want), 1e-30))
            us = 1e3 * ms
            share = layer_bytes / ceiling / (us * 1e-6) if ceiling else None
            results.append(dict(shape=shape, variant=name, us_per_layer=us, share=share, rel_err=rel,
                                timed_out_ctas=timed_out, layer_bytes=layer_bytes))
            print(f"| {name} | {us:.2f} | {'-' if share is None else f'{100 * share:.1f}%'} | {rel:.1e} | "
                  f"{timed_out} |", flush=True)
    with open(os.path.join(args.out, "kernels_persistent_gemv.json"), "w") as fh:
        json.dump(dict(ceiling=ceiling, rows=results), fh, indent=1)


if __name__ == "__main__":
    main()
