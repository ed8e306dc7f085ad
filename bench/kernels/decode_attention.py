"""Paged decode attention on the GPU: the split-sequence Pallas kernels against the XLA reference op.

    PYTHONPATH=. python3 bench/kernels/decode_attention.py [--sweep] [--budget 120] [--interpret]

Default mode: for Qwen3-4B and Llama-3-8B (H 32, KVH 8, hd 128: one attention shape) and Qwen3-0.6B
(16/8/128), bf16, page size 16, contexts 1, 100, 1024, 8192, 32768 and batch 1 and 32, it times the
configuration the table picks (jaxinfer.pallas.decode_attention.choose_config) and
reference.paged_decode_attention. Each is timed inside one jit that chains n calls (the output is the
next call's query, so the calls run one after another, as attention does layer after layer), the layer
index walking over enough layers that the KV read per call is not served from the 50 MB L2 (where a
layer is smaller than that: contexts <= 100 at batch 1 stay in L2 whatever we do); many calls of that
jit, best of 3. The first call's output of each is checked against the reference's before it counts.
Effective bandwidth = bytes of K and V the batch needs (sum of contexts x KVH x hd x 2 x 2 bytes) /
time, also as a share of the HBM read ceiling measured in the same run (jnp.sum over 4 GiB of bf16).

--sweep: first, at the 32/8/128 shape, a sweep of SplitConfigs at batch 1, 4, 16, 64 and contexts 100,
1024, 8192, 32768 (phase A: num_splits x block_k; phase B: the best two with other num_warps /
num_stages and the jnp merge), printing the best per point: what fills tables.DECODE_ATTENTION.
JSON of everything to $OUT/decode_attention.json when OUT is set.

--kv-cache-dtype fp8: the caches in float8 e4m3 (as `--kv-cache-dtype fp8` stores them; half the bytes,
the same kernels casting reads back to bf16), the bytes and bandwidth counted at 1 byte;
what fills tables.DECODE_ATTENTION_FP8. --points B:ctx ... replaces the sweep's points.
--kv-cache-dtype int8: the caches as `--kv-cache-dtype int8` stores them (int8 values, a float32 scale a vector, the
kernels taking values and scales as operands; the reference op reading the dequantized rows), the bytes counted at
1 a value + 4 a vector; --int8-convert (blocks.INT8_CONVERTS) picks the kernels' int8 conversion
(tables.DECODE_ATTENTION_INT8_CONVERT; default the table's). Int8 pages take the float8 table (1-byte pages); the sweep's best fills a table of their own
where they differ.
--query-dtype float16: queries (and so the kernels' compute dtype, which pages are cast to) in float16
(float8 e4m3 converts to float16 in one instruction; to bfloat16 it does not).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import math
import time
import warnings

import jax
import jax.numpy as jnp

from bench.ceilings import hbm_read_ceiling
from bench.kernels.kernel_timing import (add_sweep_args, build_chain, log, rel_err, save_results, sweep_and_table_between_ceilings, time_chain)

from jaxinfer.model.kv_cache import KV_CACHE_DTYPES, to_cache
from jaxinfer.ops import reference
from jaxinfer.ops.quantized_cache import QuantizedCache, quantize
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas.blocks import INT8_CONVERTS

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
PS = 16
SHAPES = [("Qwen3-4B/Llama-3-8B", 32, 8, 128), ("Qwen3-0.6B", 16, 8, 128)]
CONTEXTS = [1, 100, 1024, 8192, 32768]
BATCHES = [1, 32]
L2_BYTES = 50e6
TOL = 2e-2
INTERPRET = False
KV_DTYPE = jnp.bfloat16
Q_DTYPE = jnp.bfloat16
POINTS = None   # --points: the sweep's (B, ctx) points
INT8_CONVERT = None   # --int8-convert (None: the table's)


def vector_bytes(hd: int) -> float:
    """Bytes one cached vector of hd values costs (int8: its float32 scale too)."""
    return hd * jnp.dtype(KV_DTYPE).itemsize + (4 if jnp.dtype(KV_DTYPE) == jnp.int8 else 0)


@dataclasses.dataclass
class Problem:
    H: int
    KVH: int
    hd: int
    B: int
    ctx: int
    L: int
    args: tuple  # q, k, v, page_table, context_lens

    @property
    def kv_bytes(self):
        return self.B * self.ctx * self.KVH * 2 * vector_bytes(self.hd)


def make_problem(H, KVH, hd, B, ctx, seed=0):
    P = -(-ctx // PS)
    per_layer = B * P * PS * KVH * 2 * vector_bytes(hd)
    L = int(min(16, max(1, math.ceil(4 * L2_BYTES / per_layer))))
    if INTERPRET:
        L = 1
    n_pages = B * P + 1
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    shape = (L, KVH, n_pages * PS, hd)
    if jnp.dtype(KV_DTYPE) == jnp.int8:   # quantized vectors of magnitudes 0.1..10
        amp = 10.0 ** jax.random.uniform(kq, shape[:-1] + (1,), minval=-1, maxval=1)
        k = QuantizedCache(*jax.jit(quantize)(jax.random.normal(kk, shape, jnp.bfloat16) * amp))
        v = QuantizedCache(*jax.jit(quantize)(jax.random.normal(kv, shape, jnp.bfloat16) * amp))
    else:
        k = to_cache(jax.random.normal(kk, shape, jnp.bfloat16), KV_DTYPE)
        v = to_cache(jax.random.normal(kv, shape, jnp.bfloat16), KV_DTYPE)
    q = jax.random.normal(kq, (B, H, hd), Q_DTYPE)
    pt = jax.random.permutation(kp, jnp.arange(1, n_pages, dtype=jnp.int32))[: B * P].reshape(B, P)
    cl = jnp.full((B,), ctx, jnp.int32)
    jax.block_until_ready((q, k, v, pt, cl))
    return Problem(H, KVH, hd, B, ctx, L, (q, k, v, pt, cl))


def n_chain(est_s):
    if INTERPRET:   # a CPU dry run checks the path, not the timing (as verify_attention.py): 48 calls took ~15 s to compile
        return 2
    return int(min(48, max(4, round(400e-6 / max(est_s, 1e-6)))))


def pallas_op(cfg):
    def op(q, k, v, layer, pt, cl, ps, scale):
        if isinstance(k, QuantizedCache):
            return DA.paged_decode_attention(q, k.values, v.values, layer, pt, cl, ps, scale, k_scale=k.scale,
                                             v_scale=v.scale, config=cfg, int8_convert=INT8_CONVERT,
                                             interpret=INTERPRET)
        return DA.paged_decode_attention(q, k, v, layer, pt, cl, ps, scale, config=cfg, interpret=INTERPRET)
    return op


def build(op, p: Problem, n):
    scale = p.hd ** -0.5
    return build_chain(lambda q, k, v, pt, cl, layer: op(q, k, v, layer, pt, cl, PS, scale), p.args, n, p.L)


def time_compiled(compiled, p: Problem, n, target_s=0.02):
    return time_chain(compiled, p.args, n, target_s, max_calls=50)


def est_time(p: Problem):
    return max(4e-6, p.kv_bytes / 3.5e12)


def cfg_str(c: DA.SplitConfig):
    return f"S{c.num_splits}/bk{c.block_k}/w{c.num_warps}/s{c.num_stages}" + ("/jnp" if c.merge == "jnp" and
                                                                          c.num_splits > 1 else "")


def run_configs(p: Problem, cfgs, ref_out, pool, deadline):
    n = n_chain(est_time(p))
    futs = {pool.submit(build, pallas_op(c), p, n): c for c in cfgs}
    # Compile everything before timing anything: lowering holds the GIL, and timing while other
    # configs compiled starved the dispatch thread (the first sweep saw some configs 3-40x slow).
    cf.wait(futs)
    rows = []
    for fut in futs:
        c = futs[fut]
        row = {"cfg": dataclasses.asdict(c)}
        try:
            compiled = fut.result()
            if time.time() > deadline:
                row.update(ok=False, error="skipped: out of time budget")
            else:
                t, first = time_compiled(compiled, p, n)
                err = rel_err(first, ref_out)
                row.update(us=t * 1e6, tbps=p.kv_bytes / t / 1e12, err=err, ok=err < TOL)
        except Exception as e:  # noqa: BLE001 - a config that fails is a result too
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        rows.append(row)
    return rows


def time_reference(p: Problem):
    n = max(2, n_chain(est_time(p) * 4) // 2)  # the reference moves ~4x the bytes: fewer calls per chain
    compiled = build(reference.paged_decode_attention, p, n)
    t, first = time_compiled(compiled, p, n)
    return t, first


def phase_a(p: Problem):
    cfgs = []
    for bk in (32, 64, 128):
        n_blocks = -(-p.ctx // bk)
        for s in (1, 2, 4, 8, 16, 32, 64):
            if s > n_blocks or p.B * p.KVH * s > 16384:
                continue
            cfgs.append(DA.SplitConfig(num_splits=s, block_k=bk, num_warps=4, num_stages=2))
    return cfgs[:3] if INTERPRET else cfgs   # a CPU dry run checks the path, not the ranking


def phase_b(best):
    cfgs = []
    for c in best:
        for w in (2, 4, 8):
            for st in (1, 2, 3):
                if (w, st) != (c.num_warps, c.num_stages):
                    cfgs.append(dataclasses.replace(c, num_warps=w, num_stages=st))
        if c.num_splits > 1:
            cfgs.append(dataclasses.replace(c, merge="jnp"))
    cfgs = list(dict.fromkeys(cfgs))
    return cfgs[:2] if INTERPRET else cfgs


def sweep(results, pool, deadline, t_start):
    name, H, KVH, hd = SHAPES[0]
    points = [(1, 32768), (1, 8192), (16, 8192), (64, 8192), (4, 32768), (1, 1024), (16, 32768),
              (4, 8192), (64, 1024), (16, 1024), (4, 1024), (1, 100), (64, 100), (64, 32768)]
    if POINTS:
        points = POINTS
    elif INTERPRET:
        points = [(1, 100), (2, 300)]
    out = []
    for i, (B, ctx) in enumerate(points):
        if time.time() > deadline:
            log(f"sweep: out of budget before B={B} ctx={ctx}")
            break
        p = make_problem(H, KVH, hd, B, ctx, seed=i)
        t_ref, ref_out = time_reference(p)
        share = (deadline - time.time()) / (len(points) - i)
        rows = run_configs(p, phase_a(p), ref_out, pool, time.time() + 0.65 * share)
        good = sorted((r for r in rows if r["ok"]), key=lambda r: r["us"])
        top = [DA.SplitConfig(**r["cfg"]) for r in good[:2]]
        rows += run_configs(p, phase_b(top), ref_out, pool, time.time() + 0.35 * share)
        good = sorted((r for r in rows if r["ok"]), key=lambda r: r["us"])
        for r in rows:
            if not r["ok"] and "skipped" not in r.get("error", ""):
                log(f"   FAILED {cfg_str(DA.SplitConfig(**r['cfg']))}: {r.get('error') or 'err %.2e' % r['err']}")
        entry = {"B": B, "ctx": ctx, "kv_bytes": p.kv_bytes, "ref_us": t_ref * 1e6, "configs": rows,
                 "best": good[0] if good else None}
        out.append(entry)
        msg = "; ".join(f"{cfg_str(DA.SplitConfig(**r['cfg']))} {r['us']:.1f}" for r in good[:6])
        log(f"[{time.time() - t_start:6.1f}s] sweep B={B} ctx={ctx}: ref {t_ref * 1e6:.1f} us; "
            f"{len(good)}/{len(rows)} ok; best {msg}")
        del p
    results["sweep"] = out


def table_mode(results, pool, t_start):
    """The table's choice and the reference at every (shape, batch, context): compile all, then time."""
    jobs = []
    for name, H, KVH, hd in SHAPES:
        for B in BATCHES:
            for ctx in CONTEXTS:
                p = make_problem(H, KVH, hd, B, ctx, seed=ctx + B)
                cfg = DA.choose_config(B, KVH, -(-ctx // PS) * PS, jnp.dtype(KV_DTYPE).itemsize)
                n = n_chain(est_time(p))
                n_ref = max(2, n_chain(est_time(p) * 4) // 2)
                fut_jnp = (pool.submit(build, pallas_op(dataclasses.replace(cfg, merge="jnp")), p, n)
                           if cfg.num_splits > 1 else None)
                jobs.append((name, p, cfg, n, n_ref, pool.submit(build, pallas_op(cfg), p, n),
                             pool.submit(build, reference.paged_decode_attention, p, n_ref), fut_jnp))
    # Every compile finishes before anything is timed: lowering holds the GIL, and a starved
    # dispatch thread inflated some of the sweep's timings many times over.
    cf.wait([f for j in jobs for f in j[5:] if f is not None])
    log(f"[{time.time() - t_start:6.1f}s] table mode: {len(jobs)} points compiled")
    for name, p, cfg, n, n_ref, fut, fut_ref, fut_jnp in jobs:
        row = {"model": name, "H": p.H, "KVH": p.KVH, "hd": p.hd, "B": p.B, "ctx": p.ctx,
               "kv_bytes": p.kv_bytes, "cfg": dataclasses.asdict(cfg)}
        try:
            t_ref, ref_out = time_compiled(fut_ref.result(), p, n_ref)
            row["ref_us"] = t_ref * 1e6
            t, first = time_compiled(fut.result(), p, n)
            err = rel_err(first, ref_out)
            row.update(us=t * 1e6, tbps=p.kv_bytes / t / 1e12, err=err, ok=err < TOL)
            if fut_jnp is not None:
                t_j, first_j = time_compiled(fut_jnp.result(), p, n)
                row.update(jnp_us=t_j * 1e6, jnp_err=rel_err(first_j, ref_out))
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        results["rows"].append(row)
        log(f"[{time.time() - t_start:6.1f}s] {name} B={p.B} ctx={p.ctx} {cfg_str(cfg)}: "
            f"{row.get('us', float('nan')):.1f} us (err {row.get('err', float('nan')):.1e}) "
            f"jnp merge {row.get('jnp_us', float('nan')):.1f} us, "
            f"ref {row.get('ref_us', float('nan')):.1f} us {row.get('error', '')}")
    jobs.clear()


def main():
    ap = argparse.ArgumentParser()
    add_sweep_args(ap, budget=120.0)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"])
    ap.add_argument("--int8-convert", default=None, choices=INT8_CONVERTS, help="int8 pages: the conversion")
    ap.add_argument("--points", nargs="*", default=None, help="the sweep's points as B:ctx")
    ap.add_argument("--query-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()
    global INTERPRET, CONTEXTS, BATCHES, KV_DTYPE, POINTS, Q_DTYPE, INT8_CONVERT
    INT8_CONVERT = args.int8_convert
    Q_DTYPE = jnp.dtype(args.query_dtype)
    INTERPRET = args.interpret
    KV_DTYPE = KV_CACHE_DTYPES[args.kv_cache_dtype] or jnp.bfloat16
    POINTS = [tuple(int(v) for v in pt.split(":")) for pt in args.points] if args.points else None
    if INTERPRET:
        CONTEXTS, BATCHES = [1, 100], [1, 2]
    gib = 0.25 if INTERPRET else 4
    results, bw0, bw1, t_start = sweep_and_table_between_ceilings(
        args, sweep, table_mode, lambda: hbm_read_ceiling(gib), "hbm_read_tbps", 1e12, "HBM read ceiling TB/s")
    dev = jax.devices()[0]
    bw = max(bw0, bw1)

    conv = f" ({INT8_CONVERT or DA.tables.DECODE_ATTENTION_INT8_CONVERT})" if jnp.dtype(KV_DTYPE) == jnp.int8 else ""
    print(f"\nPaged decode attention, {jnp.dtype(Q_DTYPE).name} queries, {jnp.dtype(KV_DTYPE).name}{conv} pages of 16, on {dev.device_kind}, jax {jax.__version__}; HBM read "
          f"ceiling {bw0 / 1e12:.2f} / {bw1 / 1e12:.2f} TB/s (start / end), shares against the larger")
    hdr = (f"{'shape (H/KVH/hd)':>30} {'ctx':>6} {'B':>3} {'config':>18} {'us':>8} {'TB/s':>5} "
           f"{'share':>5} {'ref us':>8} {'speedup':>7} {'jnp-merge us':>12}")
    print(hdr)
    print("-" * len(hdr))
    for r in results["rows"]:
        shape = f"{r['model']} {r['H']}/{r['KVH']}/{r['hd']}"
        cfg = cfg_str(DA.SplitConfig(**r["cfg"]))
        if r.get("ok"):
            print(f"{shape:>30} {r['ctx']:>6} {r['B']:>3} {cfg:>18} {r['us']:8.1f} {r['tbps']:5.2f} "
                  f"{r['tbps'] * 1e12 / bw:5.0%} {r['ref_us']:8.1f} {r['ref_us'] / r['us']:6.1f}x "
                  f"{r['jnp_us'] if 'jnp_us' in r else float('nan'):12.1f}")
        else:
            print(f"{shape:>30} {r['ctx']:>6} {r['B']:>3} {cfg:>18} FAILED {r.get('error') or r.get('err')}")
    if args.sweep:
        print("\nsweep (32/8/128): best config per point")
        for e in results.get("sweep", []):
            b = e["best"]
            if b:
                print(f"  B={e['B']:>3} ctx={e['ctx']:>6}: {cfg_str(DA.SplitConfig(**b['cfg'])):>18} "
                      f"{b['us']:8.1f} us {b['tbps'] * 1e12 / bw:5.0%}  (ref {e['ref_us']:.1f} us)")
    print(f"total {time.time() - t_start:.0f} s")
    save_results(results, "decode_attention.json")


if __name__ == "__main__":
    main()
