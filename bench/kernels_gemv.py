"""Decode GEMV on the GPU: XLA's x @ w.T against the Pallas kernel over a sweep of configs.

    PYTHONPATH=. python3 bench/kernels_gemv.py [--budget 240] [--shapes 6144x2560,...] [--T 1]
    PYTHONPATH=. python3 bench/kernels_gemv.py --refine --chosen 4,8 --budget 150   # ~3 min

Run it alone on the GPU: nothing else may use the card meanwhile (a pytest run killed by `timeout`
leaves pytest-xdist workers behind that keep running kernels; see bench/NOTES.md).

For every shape (bf16, T tokens) it times reference.linear (XLA) and the Pallas GEMV over a
sweep of configs, each inside one jit that runs R x n products over n different weight matrices
(together several times the 50 MB L2, so every product reads HBM) and many calls; each config's
outputs are checked against a float32 product before it counts. The HBM read ceiling is measured in
the same run (jnp.sum(dtype=f32) over 4 GiB of bf16). Prints one table; writes the full results as
JSON to $OUT/gemv_sweep.json when OUT is set.

Phase A sweeps block_out x block_in x num_warps (straight-line code, no split); phase B takes the
best few of A per shape and tries split-K and the fori_loop variant with num_stages; phase C times
the chosen config (jaxinfer.pallas.gemv.choose_config) at T = 1, 4, 8 against XLA.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import functools
import math
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp

from bench.ceilings import hbm_read_ceiling
from bench.kernel_timing import log, rel_err, save_results

from jaxinfer.ops import reference
from jaxinfer.pallas import gemv as G

SHAPES = [(6144, 2560), (19456, 2560), (2560, 9728), (2560, 4096), (4096, 4096), (28672, 4096),
          (4096, 14336), (151936, 2560)]
L2_BYTES = 50e6
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
TOL = 1e-2


@dataclasses.dataclass
class Problem:
    n_out: int
    n_in: int
    T: int
    xs: tuple
    ws: tuple
    ref: list  # float32 products for (xs[0], ws[0]) and (xs[-1], ws[-1])

    @property
    def wbytes(self):
        return self.n_out * self.n_in * 2

    def kernels_per_call(self):
        return len(self.ws)


def make_problem(n_out, n_in, T, seed, ws=None):
    """n distinct (x, w) pairs: no operand shared (XLA's dot merger would fuse products that share
    one) and n x w bytes >= 900 MB (>= 15x the L2), so each product reads its weights from HBM."""
    wbytes = n_out * n_in * 2
    n = int(min(64, max(2, math.ceil(900e6 / wbytes))))
    if INTERPRET:
        n = 2
    kw, kx = jax.random.split(jax.random.PRNGKey(seed))
    scale = 1.0 / math.sqrt(n_in)
    if ws is None:
        ws = tuple(jax.random.normal(k, (n_out, n_in), jnp.bfloat16) * jnp.bfloat16(scale)
                   for k in jax.random.split(kw, n))
    xs = tuple(jax.random.normal(k, (T, n_in), jnp.bfloat16) for k in jax.random.split(kx, n))
    with jax.default_matmul_precision("highest"):
        f32 = jnp.float32
        ref = [jnp.dot(xs[0].astype(f32), ws[0].astype(f32).T),
               jnp.dot(xs[-1].astype(f32), ws[-1].astype(f32).T)]
    jax.block_until_ready((ws, xs, ref))
    return Problem(n_out, n_in, T, xs, ws, ref)


def build(fn, p: Problem):
    """AOT-compile one jit running fn over every (x, w) pair; returns the compiled callable."""
    def many(xs, ws):
        return [fn(x, w) for x, w in zip(xs, ws)]
    return jax.jit(many).lower(p.xs, p.ws).compile()


def time_compiled(compiled, p: Problem, target_s=0.02):
    out = compiled(p.xs, p.ws)
    jax.block_until_ready(out)
    err = max(rel_err(out[0], p.ref[0]), rel_err(out[-1], p.ref[1]))
    k = p.kernels_per_call()
    est = max(k * p.wbytes / 4e12, 20e-6)
    calls = int(min(200, max(3, target_s / est)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = compiled(p.xs, p.ws)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / (calls * k))
    return best, err


INTERPRET = False  # --interpret: a CPU dry run of this script on small shapes


def cfg_fn(cfg: G.GemvConfig):
    return functools.partial(G.gemv, block_out=cfg.block_out, block_in=cfg.block_in,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             split_k=cfg.split_k, unroll=cfg.unroll, load_policy=cfg.load_policy,
                             interpret=INTERPRET)


def phase_a_configs(n_in):
    cfgs = []
    for nw in (1, 2, 4, 8):
        lanes = 32 * nw
        for bi in (128, 256, 512, 1024):
            per_lane = bi // lanes  # consecutive bf16 per lane per row: 4 = 8-byte, 8 = 16-byte loads
            if per_lane < 4 or per_lane > 16:
                continue
            for bo in (1, 2, 4, 8, 16):
                if bo * per_lane > 64:
                    continue
                cfgs.append(G.GemvConfig(block_out=bo, block_in=bi, num_warps=nw, num_stages=1))
    return cfgs


def phase_b_configs(best, n_out, n_in):
    cfgs = []
    for c in best:
        n_tiles = -(-n_in // c.block_in)
        cfgs.append(dataclasses.replace(c, unroll=False, num_stages=1))
        cfgs.append(dataclasses.replace(c, unroll=False, num_stages=3))
        if n_out <= 8192:
            for s in (2, 4):
                if n_tiles >= 2 * s:
                    cfgs.append(dataclasses.replace(c, split_k=s))
    return cfgs


# The best six of the first full sweep (2026-11-29, bench/NOTES.md), as
# block_out/block_in/num_warps/num_stages/split_k/unroll: --refine re-times these plus EXTRAS.
PRIOR_TOP = {
    (6144, 2560): "1/128/1/1/1/1 2/128/1/1/1/1 1/512/4/1/1/0 1/512/4/1/1/1 4/1024/2/1/1/1 4/512/1/1/1/1",
    (19456, 2560): "1/128/1/3/1/0 1/128/1/1/1/1 1/128/1/1/1/0 1/512/1/1/1/1 1/512/4/1/1/1 1/512/1/1/1/0",
    (2560, 9728): "1/128/1/1/1/1 1/256/1/1/1/1 1/256/1/3/1/0 1/128/1/1/1/0 1/256/1/1/1/0 1/128/1/3/1/0",
    (2560, 4096): "2/256/1/1/1/1 4/512/4/1/1/1 8/1024/4/1/1/1 2/128/1/1/1/1 2/1024/2/1/1/1 1/512/4/1/1/1",
    (4096, 4096): "1/128/1/1/1/1 1/1024/8/1/1/1 1/256/1/1/1/1 1/1024/8/3/1/0 2/256/1/1/1/1 2/128/1/1/1/1",
    (28672, 4096): "1/512/1/1/1/1 2/256/1/1/1/1 4/128/1/1/1/1 1/256/1/1/1/1 1/512/1/1/1/0 2/512/1/1/1/1",
    (4096, 14336): "1/256/1/1/1/1 1/256/1/3/1/0 1/256/1/1/1/0 1/512/1/1/1/1 1/128/1/1/1/1 1/512/1/1/4/1",
    (151936, 2560): "1/256/1/1/1/1 1/128/1/1/1/1 2/128/1/1/1/1 1/128/1/1/1/0 1/512/1/1/1/1 2/128/1/1/1/0",
}
EXTRAS = "1/64/1/1/1/1 1/256/1/1/1/1 1/1024/1/1/1/1 2/256/1/1/1/1 1/512/2/1/1/1"


def parse_cfgs(text):
    out = []
    for item in text.split():
        bo, bi, nw, ns, sk, un = (int(v) for v in item.split("/"))
        c = G.GemvConfig(block_out=bo, block_in=bi, num_warps=nw, num_stages=ns, split_k=sk,
                         unroll=bool(un))
        if c not in out:
            out.append(c)
    return out


def refine_configs(n_out, n_in, top=5):
    prior = parse_cfgs(PRIOR_TOP.get((n_out, n_in), ""))[:top]
    table = G.choose_config(1, n_out, n_in, jnp.bfloat16)
    policies = [dataclasses.replace(table, load_policy="plain")]
    return list(dict.fromkeys(prior + [table] + policies + parse_cfgs(EXTRAS)))


def compile_then_time(p: Problem, fns: dict, pool, deadline) -> dict:
    """Compile every fn (key -> fn(x, w)) in parallel (XLA/Triton compiles release the GIL), then time
    them one at a time with the pool idle: a tracing thread holding the GIL would stall dispatch and
    inflate the times. Returns key -> {us, tbps, err, ok} or {ok: False, error}."""
    futs = {k: pool.submit(build, fn, p) for k, fn in fns.items()}
    cf.wait(list(futs.values()))
    out = {}
    for k, fut in futs.items():
        try:
            compiled = fut.result()
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result too
            out[k] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            continue
        if time.time() > deadline:
            out[k] = dict(ok=False, error="skipped: out of time budget")
            continue
        t, err = time_compiled(compiled, p)
        out[k] = dict(us=t * 1e6, tbps=p.wbytes / t / 1e12, err=err, ok=err < TOL)
    return out


def run_configs(p: Problem, cfgs, pool, deadline):
    res = compile_then_time(p, {c: cfg_fn(c) for c in cfgs}, pool, deadline)
    return [{"cfg": dataclasses.asdict(c), **r} for c, r in res.items()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole sweep")
    ap.add_argument("--shapes", default=None, help="comma list of OUTxIN")
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--top", type=int, default=3, help="phase-A configs carried into phase B")
    ap.add_argument("--threads", type=int, default=min(14, os.cpu_count() or 4))
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (tiny shapes)")
    ap.add_argument("--max-configs", type=int, default=0, help="cap phase A (0: all)")
    ap.add_argument("--refine", action="store_true",
                    help="instead of phases A and B: PRIOR_TOP, the table's choice and EXTRAS")
    ap.add_argument("--chosen", default="", help="phase C token counts, e.g. 4,8 (default: none)")
    args = ap.parse_args()
    global INTERPRET
    INTERPRET = args.interpret
    t_start = time.time()
    deadline = t_start + args.budget
    shapes = SHAPES if args.shapes is None else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}, {datetime.datetime.now().isoformat()}")
    gib = 1 if args.interpret else 4
    bw0 = hbm_read_ceiling(gib)
    log(f"HBM read ceiling {bw0 / 1e12:.3f} TB/s")

    results = {"device": dev.device_kind, "jax": jax.__version__, "argv": sys.argv[1:],
               "date": datetime.datetime.now().isoformat(), "T": args.T, "shapes": []}
    pool = cf.ThreadPoolExecutor(args.threads)
    for si, (n_out, n_in) in enumerate(shapes):
        p = make_problem(n_out, n_in, args.T, seed=si)
        xla_t, xla_err = time_compiled(build(reference.linear, p), p)
        log(f"[{time.time() - t_start:6.1f}s] {n_out}x{n_in}: XLA {xla_t * 1e6:.2f} us "
            f"{p.wbytes / xla_t / 1e12:.2f} TB/s (err {xla_err:.1e}); {len(p.ws)} pairs per call")
        # Leave the later shapes their share of the budget.
        share = (deadline - time.time()) / (len(shapes) - si)
        if args.refine:
            rows = run_configs(p, refine_configs(n_out, n_in), pool, time.time() + 0.9 * share)
        else:
            cfgs_a = phase_a_configs(n_in)
            if args.max_configs:
                cfgs_a = cfgs_a[:: max(1, len(cfgs_a) // args.max_configs)][: args.max_configs]
            rows = run_configs(p, cfgs_a, pool, time.time() + 0.7 * share)
            good = sorted((r for r in rows if r["ok"]), key=lambda r: r["us"])
            top = [G.GemvConfig(**r["cfg"]) for r in good[: args.top]]
            rows += run_configs(p, phase_b_configs(top, n_out, n_in), pool,
                                time.time() + 0.3 * share)
        good = sorted((r for r in rows if r["ok"]), key=lambda r: r["us"])
        bad = [r for r in rows if not r["ok"] and "skipped" not in r.get("error", "")]
        for r in bad:
            log(f"   FAILED {r['cfg']}: {r.get('error') or 'err %.2e' % r['err']}")
        table_cfg = dataclasses.asdict(G.choose_config(args.T, n_out, n_in, jnp.bfloat16))
        table_row = next((r for r in good if r["cfg"] == table_cfg), None)
        entry = {"out": n_out, "in": n_in, "bytes": p.wbytes, "xla_us": xla_t * 1e6,
                 "xla_tbps": p.wbytes / xla_t / 1e12, "xla_err": xla_err, "configs": rows,
                 "best": good[0] if good else None, "table": table_row, "chosen": []}
        if good:
            log(f"   best {good[0]['cfg']}: {good[0]['us']:.2f} us {good[0]['tbps']:.2f} TB/s; "
                "top5 " + "; ".join(f"{cfg_str(r['cfg'])} {r['us']:.2f}" for r in good[:5]))
        # Phase C: what choose_config picks at other token counts, against XLA. Built here, one at
        # a time: XLA autotunes its dots on the GPU while compiling, which must not overlap timing.
        for T in [int(v) for v in args.chosen.split(",") if v]:
            pT = make_problem(n_out, n_in, T, seed=100 + si, ws=p.ws)
            cfg = G.choose_config(T, n_out, n_in, jnp.bfloat16)
            try:
                t, err = time_compiled(build(cfg_fn(cfg), pT), pT)
                tx, _ = time_compiled(build(reference.linear, pT), pT)
            except Exception as e:  # noqa: BLE001
                log(f"   chosen T={T} FAILED: {type(e).__name__}: {str(e)[:300]}")
                continue
            entry["chosen"].append({"T": T, "cfg": dataclasses.asdict(cfg), "us": t * 1e6,
                                    "err": err, "ok": err < TOL, "xla_us": tx * 1e6})
            log(f"   T={T} {cfg_str(dataclasses.asdict(cfg))}: {t * 1e6:.2f} us (err {err:.1e}) "
                f"XLA {tx * 1e6:.2f} us")
        results["shapes"].append(entry)
        del p
    pool.shutdown(wait=False, cancel_futures=True)
    bw1 = hbm_read_ceiling(gib)
    results["hbm_read_tbps"] = [bw0 / 1e12, bw1 / 1e12]
    bw = max(bw0, bw1)

    print(f"\nGEMV bf16 T={args.T} on {dev.device_kind}, jax {jax.__version__}; HBM read ceiling "
          f"{bw0 / 1e12:.2f} / {bw1 / 1e12:.2f} TB/s (start / end), shares against the larger")
    hdr = (f"{'out x in':>14} {'MB':>6} | {'best bo/bi/w/s/k/u':>21} {'us':>7} {'TB/s':>5} "
           f"{'share':>5} | {'table us':>8} {'share':>5} | {'XLA us':>7} {'TB/s':>5} {'share':>5}"
           f" | {'T: pallas/XLA us':>24}")
    print(hdr)
    print("-" * len(hdr))
    for e in results["shapes"]:
        b, tb = e["best"], e["table"]
        bs = (f"{cfg_str(b['cfg']):>21} {b['us']:7.2f} {b['tbps']:5.2f} {b['tbps'] * 1e12 / bw:5.0%}"
              if b else f"{'(none valid)':>21} {'':>7} {'':>5} {'':>5}")
        ts = (f"{tb['us']:8.2f} {tb['tbps'] * 1e12 / bw:5.0%}" if tb else f"{'-':>8} {'':>5}")
        ch = " ".join(f"{r['T']}: {r['us']:.1f}/{r['xla_us']:.1f}" for r in e["chosen"])
        print(f"{e['out']:>6} x {e['in']:<5} {e['bytes'] / 1e6:6.1f} | {bs} | {ts} | "
              f"{e['xla_us']:7.2f} {e['xla_tbps']:5.2f} {e['xla_tbps'] * 1e12 / bw:5.0%} | {ch:>24}")
    print(f"total {time.time() - t_start:.0f} s")
    save_results(results, "gemv_sweep.json")


def cfg_str(c):
    lp = {"evict_first": "", "plain": "/plain"}[c.get("load_policy", "evict_first")]
    return (f"{c['block_out']}/{c['block_in']}/{c['num_warps']}/{c['num_stages']}/"
            f"{c['split_k']}/{int(c['unroll'])}{lp}")


if __name__ == "__main__":
    main()
