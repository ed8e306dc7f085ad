"""Speculative verify attention (pallas/verify_attention.py) on the GPU: Q rows a sequence in one split-sequence
kernel, against the decode kernel at Q = 1, and its config sweep.

    PYTHONPATH=. python3 bench/kernels/verify_attention.py [--sweep] [--no-table] [--budget 300] [--heads 32:8]
        [--points Q:B:ctx ...] [--kv-cache-dtype fp8] [--interpret]

Qwen3-4B's attention (H 32, KVH 8, hd 128; --heads 64:8 for groups of 8, 128-row tiles at Q 16), bf16 queries,
page size 16, pages in random order, page tables just covering the context. Each config runs inside one jit as a
chain of calls (the output is the next call's query: the calls run one after another, as layers do), the layer
index walking over enough layers that the K/V read is not served from the 50 MB L2; best of 3 timed runs. Each
first output is checked against reference.verify_attention (layer 0) before it counts.

Table mode (default): Q 1, 4, 8, 16 x contexts 1k, 8k, 32k x batch 1, 8: the table's config
(verify_attention.choose_config) and, at Q = 1, the decode kernel (decode_attention.paged_decode_attention, its
own table) on the same query. Effective bandwidth = the K/V bytes the batch must read (B x ctx x KVH x hd x 2 x
itemsize) / time, and its share of the HBM read ceiling measured in the same run (jnp.sum over 4 GiB of bf16).

--sweep: at Q 4, 8, 16 x batch 1, 8 x contexts 1k, 8k, 32k (or --points), phase A num_splits x block_k at the
table's num_warps, phase B the best two with num_warps 2/4/8, num_stages 1/2/3 and the jnp merge; prints the best
per point and the tables.VERIFY_ATTENTION key it falls under. JSON to $OUT/verify_attention.json.
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
from bench.kernels.kernel_timing import (add_sweep_args, build_chain, log, rel_err, save_results,
                                         sweep_and_table_between_ceilings, time_chain)
from jaxinfer.model.kv_cache import KV_CACHE_DTYPES, to_cache
from jaxinfer.ops import reference
from jaxinfer.pallas import decode_attention as DA
from jaxinfer.pallas import verify_attention as VA
from jaxinfer.pallas.blocks import pow2_at_least

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
PS, HD = 16, 128
HEADS = (32, 8)
Q_VALUES = [1, 4, 8, 16]
CONTEXTS = [1024, 8192, 32768]
BATCHES = [1, 8]
SWEEP_POINTS = [(q, b, c) for q in (4, 8, 16) for b in (1, 8) for c in (1024, 8192, 32768)]
L2_BYTES = 50e6
TOL = 2e-2
INTERPRET = False
KV_DTYPE = jnp.bfloat16
ref_op = jax.jit(reference.verify_attention, static_argnums=(6, 7))


@dataclasses.dataclass
class Problem:
    Q: int
    B: int
    ctx: int
    L: int
    args: tuple  # q [B, Q, H, hd], k, v, page_table, context_lens

    @property
    def rows(self) -> int:
        return self.Q * HEADS[0] // HEADS[1]

    @property
    def kv_bytes(self) -> int:
        return self.B * self.ctx * HEADS[1] * HD * 2 * jnp.dtype(KV_DTYPE).itemsize

    def table_config(self) -> DA.SplitConfig:
        return VA.choose_config(self.rows, self.B, HEADS[1], -(-self.ctx // PS) * PS)


def make_problem(Q, B, ctx, seed=0) -> Problem:
    H, KVH = HEADS
    P = -(-ctx // PS)
    per_layer = B * P * PS * KVH * HD * 2 * jnp.dtype(KV_DTYPE).itemsize
    L = 1 if INTERPRET else int(min(16, max(1, math.ceil(4 * L2_BYTES / per_layer))))
    n_pages = B * P + 1
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    shape = (L, KVH, n_pages * PS, HD)
    k = to_cache(jax.random.normal(kk, shape, jnp.bfloat16), KV_DTYPE)
    v = to_cache(jax.random.normal(kv, shape, jnp.bfloat16), KV_DTYPE)
    q = jax.random.normal(kq, (B, Q, H, HD), jnp.bfloat16)
    pt = jax.random.permutation(kp, jnp.arange(1, n_pages, dtype=jnp.int32))[: B * P].reshape(B, P)
    cl = jnp.full((B,), ctx, jnp.int32)
    jax.block_until_ready((q, k, v, pt, cl))
    return Problem(Q, B, ctx, L, (q, k, v, pt, cl))


def verify_op(cfg):
    def op(q, k, v, layer, pt, cl, ps, scale):
        return VA.paged_verify_attention(q, k, v, layer, pt, cl, ps, scale, config=cfg, interpret=INTERPRET)
    return op


def decode_op(q, k, v, layer, pt, cl, ps, scale):
    """The decode kernel (its own table's config) on a Q = 1 query."""
    return DA.paged_decode_attention(q[:, 0], k, v, layer, pt, cl, ps, scale, interpret=INTERPRET)[:, None]


def build(op, p: Problem, n: int):
    return build_chain(lambda q, k, v, pt, cl, layer: op(q, k, v, layer, pt, cl, PS, HD ** -0.5), p.args, n, p.L)


def n_chain(p: Problem) -> int:
    return 2 if INTERPRET else int(min(48, max(4, round(400e-6 / max(p.kv_bytes / 3.5e12, 4e-6)))))


def reference_out(p: Problem) -> jax.Array:
    q, k, v, pt, cl = p.args
    return ref_op(q, k, v, jnp.int32(0), pt, cl, PS, HD ** -0.5)


def time_built(fut, p: Problem, n: int, ref) -> dict:
    """Time one compiled chain (a future of build) and check its first output; a failure is a row too."""
    try:
        t, first = time_chain(fut.result(), p.args, n, 0.0 if INTERPRET else 0.02, max_calls=50)
        err = rel_err(first, ref)
        return dict(us=t * 1e6, tbps=p.kv_bytes / t / 1e12, err=err, ok=err < TOL)
    except Exception as e:  # noqa: BLE001 - a config that fails is a result too
        return dict(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")


def cfg_str(c: DA.SplitConfig) -> str:
    return f"S{c.num_splits}/bk{c.block_k}/w{c.num_warps}/s{c.num_stages}" + (
        "/jnp" if c.merge == "jnp" and c.num_splits > 1 else "")


def phase_a(p: Problem) -> list[DA.SplitConfig]:
    warps = p.table_config().num_warps
    cfgs = []
    for bk in (32, 64, 128):
        n_blocks = -(-p.ctx // bk)
        for s in (1, 2, 4, 8, 16, 32, 64):
            if s <= n_blocks and p.B * HEADS[1] * s <= 16384:
                cfgs.append(DA.SplitConfig(num_splits=s, block_k=bk, num_warps=warps))
    return cfgs[:3] if INTERPRET else cfgs   # a CPU dry run checks the path, not the ranking


def phase_b(best: list[DA.SplitConfig]) -> list[DA.SplitConfig]:
    cfgs = []
    for c in best:
        cfgs += [dataclasses.replace(c, num_warps=w, num_stages=st) for w in (2, 4, 8) for st in (1, 2, 3)]
        if c.num_splits > 1:
            cfgs.append(dataclasses.replace(c, merge="jnp"))
    cfgs = [c for c in dict.fromkeys(cfgs) if c not in best]
    return cfgs[:2] if INTERPRET else cfgs


def run_configs(p: Problem, cfgs, ref, pool, deadline) -> list[dict]:
    n = n_chain(p)
    futs = {pool.submit(build, verify_op(c), p, n): c for c in cfgs}
    # Compile everything before timing anything: lowering holds the GIL (a starved dispatch thread inflated timings).
    cf.wait(futs)
    rows = []
    for fut, c in futs.items():
        row = {"cfg": dataclasses.asdict(c)}
        row.update(time_built(fut, p, n, ref) if time.time() < deadline else
                   dict(ok=False, error="skipped: out of time budget"))
        rows.append(row)
    return rows


def table_key(p: Problem) -> tuple[int, int, int]:
    """The (tile rows, sequence-heads, span) a point looks up in tables.VERIFY_ATTENTION."""
    return pow2_at_least(p.rows, 16), p.B * HEADS[1], -(-p.ctx // PS) * PS


def sweep(results, pool, deadline, t_start):
    points = POINTS or ([(4, 1, 100), (16, 2, 300)] if INTERPRET else SWEEP_POINTS)
    out = []
    for i, (Q, B, ctx) in enumerate(points):
        if time.time() > deadline:
            log(f"sweep: out of budget before Q={Q} B={B} ctx={ctx}")
            break
        p = make_problem(Q, B, ctx, seed=i)
        ref = reference_out(p)
        share = (deadline - time.time()) / (len(points) - i)
        rows = run_configs(p, phase_a(p), ref, pool, time.time() + 0.65 * share)
        good = sorted((r for r in rows if r["ok"]), key=lambda r: r["us"])
        rows += run_configs(p, phase_b([DA.SplitConfig(**r["cfg"]) for r in good[:2]]), ref, pool,
                            time.time() + 0.35 * share)
        good = sorted((r for r in rows if r["ok"]), key=lambda r: r["us"])
        for r in rows:
            if not r["ok"] and "skipped" not in r.get("error", ""):
                log(f"   FAILED {cfg_str(DA.SplitConfig(**r['cfg']))}: {r.get('error') or 'err %.2e' % r['err']}")
        out.append({"Q": Q, "B": B, "ctx": ctx, "key": table_key(p), "kv_bytes": p.kv_bytes, "configs": rows,
                    "best": good[0] if good else None})
        msg = "; ".join(f"{cfg_str(DA.SplitConfig(**r['cfg']))} {r['us']:.1f}" for r in good[:6])
        log(f"[{time.time() - t_start:6.1f}s] sweep Q={Q} B={B} ctx={ctx}: {len(good)}/{len(rows)} ok; best {msg}")
        del p
    results["sweep"] = out


def table_mode(results, pool, t_start):
    """The table's config at every (Q, batch, context), and the decode kernel at Q = 1: compile all, then time."""
    jobs = []
    for Q in Q_VALUES:
        for B in BATCHES:
            for ctx in CONTEXTS:
                p = make_problem(Q, B, ctx, seed=Q * 100 + B + ctx)
                n = n_chain(p)
                cfg = p.table_config()
                jobs.append((p, cfg, n, pool.submit(build, verify_op(cfg), p, n),
                             pool.submit(build, decode_op, p, n) if Q == 1 else None))
    cf.wait([f for j in jobs for f in j[3:] if f is not None])
    log(f"[{time.time() - t_start:6.1f}s] table mode: {len(jobs)} points compiled")
    for p, cfg, n, fut, fut_decode in jobs:
        ref = reference_out(p)
        row = {"Q": p.Q, "B": p.B, "ctx": p.ctx, "kv_bytes": p.kv_bytes, "cfg": dataclasses.asdict(cfg)}
        row.update(time_built(fut, p, n, ref))
        if fut_decode is not None:
            row["decode"] = time_built(fut_decode, p, n, ref)
        results["rows"].append(row)
        log(f"[{time.time() - t_start:6.1f}s] Q={p.Q} B={p.B} ctx={p.ctx} {cfg_str(cfg)}: "
            f"{row.get('us', float('nan')):.1f} us (err {row.get('err', float('nan')):.1e}) "
            f"decode {row.get('decode', {}).get('us', float('nan')):.1f} us {row.get('error', '')}")
        del p


POINTS = None


def main():
    ap = argparse.ArgumentParser()
    add_sweep_args(ap, budget=300.0)
    ap.add_argument("--heads", default="32:8", help="query heads:KV heads (64:8: groups of 8, 128-row tiles at Q 16)")
    ap.add_argument("--points", nargs="*", default=None, help="the sweep's points as Q:B:ctx")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    args = ap.parse_args()
    global INTERPRET, HEADS, POINTS, KV_DTYPE, Q_VALUES, CONTEXTS, BATCHES
    INTERPRET = args.interpret
    HEADS = tuple(int(x) for x in args.heads.split(":"))
    POINTS = [tuple(int(x) for x in pt.split(":")) for pt in args.points] if args.points else None
    KV_DTYPE = KV_CACHE_DTYPES[args.kv_cache_dtype] or jnp.bfloat16
    if INTERPRET:
        Q_VALUES, CONTEXTS, BATCHES = [1, 4], [40], [2]
    gib = 0.25 if INTERPRET else 4
    results, bw0, bw1, t_start = sweep_and_table_between_ceilings(
        args, sweep, table_mode, lambda: hbm_read_ceiling(gib), "hbm_read_tbps", 1e12, "HBM read ceiling TB/s")
    bw = max(bw0, bw1)
    H, KVH = HEADS

    print(f"\nVerify attention, H {H} / KVH {KVH} / hd {HD}, bf16 queries, {jnp.dtype(KV_DTYPE).name} pages of {PS}, "
          f"on {jax.devices()[0].device_kind}, jax {jax.__version__}; HBM read ceiling {bw0 / 1e12:.2f} / "
          f"{bw1 / 1e12:.2f} TB/s (start / end), shares against the larger")
    hdr = f"{'Q':>3} {'B':>3} {'ctx':>6} {'config':>18} {'us':>8} {'TB/s':>5} {'share':>5} {'decode us':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in results["rows"]:
        head = f"{r['Q']:>3} {r['B']:>3} {r['ctx']:>6} {cfg_str(DA.SplitConfig(**r['cfg'])):>18}"
        if r.get("ok"):
            dec = r.get("decode", {})
            print(f"{head} {r['us']:8.1f} {r['tbps']:5.2f} {r['tbps'] * 1e12 / bw:5.0%} "
                  f"{dec['us'] if dec.get('ok') else float('nan'):9.1f}")
        else:
            print(f"{head} FAILED {r.get('error') or r.get('err')}")
    if args.sweep:
        print(f"\nsweep ({H}/{KVH}/{HD}): best config per point, with its key (tile rows, seq-heads, span) and the "
              f"table's config")
        for e in results.get("sweep", []):
            b = e["best"]
            if b:
                rows, sh, span = e["key"]
                table = cfg_str(VA.choose_config(rows, e["B"], KVH, span))
                print(f"  Q={e['Q']:>2} B={e['B']:>3} ctx={e['ctx']:>6} key ({rows}, {sh}, {span}): "
                      f"{cfg_str(DA.SplitConfig(**b['cfg'])):>18} {b['us']:8.1f} us "
                      f"{b['tbps'] * 1e12 / bw:5.0%}  (table: {table})")
    print(f"total {time.time() - t_start:.0f} s")
    save_results(results, "verify_attention.json")


if __name__ == "__main__":
    main()
