"""Sliding-window attention on the GPU: what skipping the blocks before the window saves.

    PYTHONPATH=. python3 bench/kernels/sliding_window.py [--interpret]

Mistral-7B's attention shape (H 32, KVH 8, hd 128, window 4,096), bf16, pages of 16 in random order: the split-
sequence decode kernel at batch 1 and 8 and the prefill kernel on a chunk of 1,024 rows after a cached prefix, at
contexts of 1-4x the window, each timed with the window (the kernels start at the window's first block) and
without it (every position), inside one jit that chains n calls (the output is the next call's query) over
enough layers that the K/V do not sit in L2; best of 3. Each windowed output is checked against the reference
op's with the window before it counts. Bytes: the K and V a call must read (the window's, or the whole context),
and the share of the HBM read ceiling measured in the same run. --interpret: a CPU dry run at tiny shapes.
JSON to $OUT/sliding_window.json when OUT is set.
"""

from __future__ import annotations

import argparse
import warnings

import jax
import jax.numpy as jnp

from bench.ceilings import hbm_read_ceiling
from bench.kernels.kernel_timing import build_chain, log, rel_err, save_results, time_chain
from jaxinfer.ops import reference
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas import prefill_attention as PA

PS = 16
L2_BYTES = 50e6


def _caches(key, L, KVH, n_pages, hd):
    kk, kv = jax.random.split(key)
    shape = (L, KVH, n_pages * PS, hd)
    return jax.random.normal(kk, shape, jnp.bfloat16), jax.random.normal(kv, shape, jnp.bfloat16)


def _layers(per_layer_bytes: float, interpret: bool) -> int:
    return 1 if interpret else int(min(16, max(1, -(-4 * L2_BYTES // per_layer_bytes))))


def decode_row(H, KVH, hd, B, ctx, window, interpret, n=8):
    P = -(-ctx // PS)
    L = _layers(B * P * PS * KVH * hd * 4, interpret)
    kq, kc, kp = jax.random.split(jax.random.PRNGKey(B * 7 + ctx), 3)
    k, v = _caches(kc, L, KVH, B * P + 1, hd)
    q = jax.random.normal(kq, (B, H, hd), jnp.bfloat16)
    pt = jax.random.permutation(kp, jnp.arange(1, B * P + 1, dtype=jnp.int32)).reshape(B, P)
    cl = jnp.full((B,), ctx, jnp.int32)
    args = (q, k, v, pt, cl)
    scale = hd ** -0.5
    row = {"kernel": "decode", "B": B, "ctx": ctx, "window": window}
    for name, w in (("windowed", jnp.int32(window)), ("whole", None)):
        def op(q, k, v, pt, cl, layer, w=w):
            return DA.paged_decode_attention(q, k, v, layer, pt, cl, PS, scale, window=w, interpret=interpret)
        seconds, first = time_chain(build_chain(op, args, n, L), args, n, 0.02, max_calls=50)
        row[f"{name}_us"] = 1e6 * seconds
        if w is not None:
            ref = reference.paged_decode_attention(q, k, v, jnp.int32(0), pt, cl, PS, scale, window=w)
            row["rel_err"] = rel_err(first, ref)
    row["bytes"] = B * min(ctx, window) * KVH * hd * 4
    return row


def prefill_row(H, KVH, hd, rows, ctx, window, interpret, n=4):
    P = -(-ctx // PS)
    L = _layers(P * PS * KVH * hd * 4, interpret)
    kq, kc, kp = jax.random.split(jax.random.PRNGKey(rows + ctx), 3)
    k, v = _caches(kc, L, KVH, P + 1, hd)
    q = jax.random.normal(kq, (rows, H, hd), jnp.bfloat16)
    pt = jax.random.permutation(kp, jnp.arange(1, P + 1, dtype=jnp.int32)).reshape(1, P)
    positions = jnp.arange(ctx - rows, ctx, dtype=jnp.int32)
    seq = jnp.zeros(rows, jnp.int32)
    args = (q, k, v, pt, seq, positions)
    scale = hd ** -0.5
    row = {"kernel": "prefill", "B": 1, "rows": rows, "ctx": ctx, "window": window}
    for name, w in (("windowed", jnp.int32(window)), ("whole", None)):
        def op(q, k, v, pt, seq, positions, layer, w=w):
            return PA.paged_attention(q, k, v, layer, pt, seq, positions, PS, scale, window=w, interpret=interpret)
        seconds, first = time_chain(build_chain(op, args, n, L), args, n, 0.02, max_calls=20)
        row[f"{name}_us"] = 1e6 * seconds
        if w is not None:
            ref = reference.paged_attention(q, k, v, jnp.int32(0), pt, seq, positions, PS, scale, window=w)
            row["rel_err"] = rel_err(first, ref)
    row["bytes"] = min(ctx, window + rows) * KVH * hd * 4
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (tiny shapes)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    if a.interpret:
        H, KVH, hd, W, contexts, batches, rows = 4, 2, 32, 32, (64, 128), (1, 2), 16
        bw = None
    else:
        H, KVH, hd, W, contexts, batches, rows = 32, 8, 128, 4096, (4096, 8192, 16384), (1, 8), 1024
        bw = hbm_read_ceiling()
        log(f"HBM read ceiling {bw / 1e12:.2f} TB/s")
    print(f"{'kernel':8s} {'B':>3s} {'ctx':>6s} {'window':>6s} {'windowed us':>12s} {'whole us':>9s} {'speedup':>8s} "
          f"{'window GB/s':>11s} {'% ceiling':>9s} {'rel err':>8s}", flush=True)
    results = []
    points = [("decode", B, ctx) for B in batches for ctx in contexts] + [("prefill", 1, ctx) for ctx in contexts]
    for kernel, B, ctx in points:
        row = decode_row(H, KVH, hd, B, ctx, W, a.interpret) if kernel == "decode" else \
            prefill_row(H, KVH, hd, rows, ctx, W, a.interpret)
        gbs = row["bytes"] / (row["windowed_us"] * 1e-6) / 1e9
        share = f"{100 * gbs * 1e9 / bw:8.1f}%" if bw else f"{'-':>9s}"
        print(f"{kernel:8s} {B:3d} {ctx:6d} {W:6d} {row['windowed_us']:12.1f} {row['whole_us']:9.1f} "
              f"{row['whole_us'] / row['windowed_us']:7.2f}x {gbs:11.1f} {share} {row['rel_err']:8.1e}", flush=True)
        results.append(row)
    save_results({"ceiling_bytes_per_s": bw, "rows": results}, "sliding_window.json")


if __name__ == "__main__":
    main()
