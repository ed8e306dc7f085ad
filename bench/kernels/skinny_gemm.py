"""Batched-decode projections on the GPU: XLA's GEMM against the Pallas skinny tensor-core GEMM.

    PYTHONPATH=. python3 bench/kernels/skinny_gemm.py [--sweep] [--budget 200] [--interpret]

For each weight shape of Qwen3-4B and Llama-3-8B (bf16) and M rows (one per sequence of the
batch) it times, inside one jit over n different weight matrices (together >= 900 MB, so every
product reads HBM; kernels_gemv.make_problem), XLA's product (reference.linear; for the gate/up
shape reference.swiglu of it) and the kernel with the config `skinny_gemm.choose_config` picks,
checked against a float32 product. Reports microseconds, TB/s of weight reads and the share of
the HBM read ceiling measured in the same run.

--sweep first searches configs at M = 16 and 64 on the Qwen3-4B shapes (phase A: block_n x block_k x
split_k at 4 warps / 4 stages; phase B: the best three with other warps and stages) and prints the
best per case: what fills tables.SKINNY_GEMM. JSON to $OUT/skinny_gemm.json when OUT is set.

--epilogues swiglu (or none, residual): only those products.

--norm: the products that follow an RMSNorm (QKV, gate/up) with the norm in: XLA's rms_norm_linear /
rms_norm_swiglu against XLA's norm then the kernel (as ops.pallas calls it). (A norm prologue inside
the kernel, x * scale on the loaded tiles, measured 2-3x slower than this on the H200.)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import functools
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp

import bench.kernels.problem as KG
from bench.ceilings import hbm_read_ceiling
from bench.kernels.kernel_timing import log, save_results

from jaxinfer.ops import reference
from jaxinfer.pallas import skinny_gemm as SG

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
SHAPES = {"qwen3-4b": [(6144, 2560, "none"), (2560, 4096, "residual"), (19456, 2560, "swiglu"), (2560, 9728, "residual")],
          "llama3-8b": [(6144, 4096, "none"), (4096, 4096, "residual"), (28672, 4096, "swiglu"),
                        (4096, 14336, "residual")]}
MS = [2, 8, 16, 32, 64, 128]
SWEEP_MS = [16, 64]
INTERPRET = False
NORM = False
EPS = 1e-6


def problem(n_out, n_in, M, epilogue, seed=0):
    p = KG.make_problem(n_out, n_in, M, seed)
    if NORM:   # the reference of rms_norm(x) @ w.T (unit scale), in float32
        f32 = jnp.float32
        with jax.default_matmul_precision("highest"):
            p.ref = [jnp.dot(reference.rms_norm(p.xs[i].astype(f32), jnp.ones((n_in,), f32), EPS),
                             p.ws[i].astype(f32).T) for i in (0, -1)]
    if epilogue == "swiglu":
        p.ref = [reference.swiglu(r) for r in p.ref]
    return p


def norm_scale(x):
    return jnp.ones((x.shape[-1],), x.dtype)


def kernel_fn(cfg, epilogue):
    # The residual epilogue reads one more [M, N] array; its cost is that of the plain product plus
    # M x N x 2 bytes, so the plain product stands for it here.
    ep = "swiglu" if epilogue == "swiglu" else "none"
    fn = functools.partial(SG.skinny_gemm, epilogue=ep, config=cfg, interpret=INTERPRET)
    if NORM:   # the norm as its own XLA kernel first, as ops.pallas runs it
        return lambda x, w: fn(reference.rms_norm(x, norm_scale(x), EPS), w)
    return fn


def xla_fn(epilogue):
    if NORM:
        if epilogue == "swiglu":
            return lambda x, w: reference.rms_norm_swiglu(x, norm_scale(x), EPS, w)
        return lambda x, w: reference.rms_norm_linear(x, norm_scale(x), EPS, w)
    if epilogue == "swiglu":
        return lambda x, w: reference.swiglu(reference.linear(x, w))
    return reference.linear


def phase_a(K):
    cfgs = []
    for bn in (32, 64, 128):
        for bk in (64, 128, 256):
            for s in (1, 2, 4, 8):
                if s == 1 or -(-K // bk) >= 2 * s:
                    cfgs.append(SG.SkinnyConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=4, split_k=s))
    return cfgs


def phase_b(best):
    return [dataclasses.replace(c, num_warps=w, num_stages=s) for c in best for w in (4, 8) for s in (2, 3, 4, 5, 6)
            if (w, s) != (c.num_warps, c.num_stages)]


def cfg_str(c: SG.SkinnyConfig):
    return f"{c.block_n}/{c.block_k}/w{c.num_warps}/s{c.num_stages}/k{c.split_k}"


def speed(p, us: float, ceiling: float) -> tuple[str, float]:
    """(unit, share of the ceiling): TB/s of weights."""
    rate = p.wbytes / (us * 1e-6)
    return f"{rate / 1e12:.2f} TB/s", rate / ceiling


def sweep_winners(results: dict, margin: float = 0.97) -> list[dict]:
    """The sweep's best config per (shape, epilogue, M) where it beat XLA's time at that M in the same
    run's table (by `margin`): rows for tables.SKINNY_GEMM (bench/throughput.py --skinny-table)."""
    xla = {(tuple(r["shape"]), r["epilogue"], r["M"]): r["xla_us"] for r in results["rows"] if r.get("xla_ok")}
    out = []
    for e in results["sweep"]:
        ref = xla.get((tuple(e["shape"]), e["epilogue"], e["M"]))
        if e["top"] and ref is not None and e["top"][0]["us"] < margin * ref:
            out.append(dict(shape=e["shape"], epilogue=e["epilogue"], M=e["M"], cfg=e["top"][0]["cfg"],
                            us=e["top"][0]["us"], xla_us=ref))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the sweep")
    ap.add_argument("--models", default="qwen3-4b,llama3-8b")
    ap.add_argument("--threads", type=int, default=min(14, os.cpu_count() or 4))
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (tiny shapes)")
    ap.add_argument("--norm", action="store_true", help="QKV and gate/up with their RMSNorm in the product")
    ap.add_argument("--sweep-ms", type=int, nargs="*", default=None, help="the sweep's M values (default 16 64)")
    ap.add_argument("--ms", type=int, nargs="*", default=None, help="the table's M values")
    ap.add_argument("--epilogues", nargs="*", default=None, choices=["none", "residual", "swiglu"],
                    help="only the products with these epilogues (default all)")
    args = ap.parse_args()
    global INTERPRET, SHAPES, MS, SWEEP_MS, NORM
    INTERPRET = KG.INTERPRET = args.interpret
    NORM = args.norm
    if NORM:
        SHAPES = {m: [s for s in shapes if s[2] != "residual"] for m, shapes in SHAPES.items()}
    if args.epilogues:
        SHAPES = {m: [s for s in shapes if s[2] in args.epilogues] for m, shapes in SHAPES.items()}
    if args.sweep_ms:
        SWEEP_MS = args.sweep_ms
    if args.ms:
        MS = args.ms
    if INTERPRET:
        SHAPES = {"tiny": [(96, 64, "none"), (128, 64, "swiglu")]}
        MS, SWEEP_MS = [2, 16], [16]
    t_start = time.time()
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}, {datetime.datetime.now().isoformat()}")
    bw = hbm_read_ceiling(0.125 if INTERPRET else 4)
    log(f"HBM read ceiling {bw / 1e12:.2f} TB/s")
    results = {"device": dev.device_kind, "jax": jax.__version__, "argv": sys.argv[1:], "bw": bw,
               "date": datetime.datetime.now().isoformat(), "sweep": [], "rows": []}
    pool = cf.ThreadPoolExecutor(args.threads)
    models = [m for m in args.models.split(",") if m in SHAPES] or list(SHAPES)
    if args.sweep:
        deadline = time.time() + args.budget
        first = models[0]
        for n_out, n_in, ep in SHAPES[first]:
            for M in SWEEP_MS:
                p = problem(n_out, n_in, M, ep)
                first_phase = phase_a(n_in)
                if INTERPRET:   # a CPU dry run checks the path, not the ranking
                    first_phase = first_phase[:3]
                a = KG.compile_then_time(p, {c: kernel_fn(c, ep) for c in first_phase}, pool, deadline)
                ranked = sorted((r["us"], c) for c, r in a.items() if r.get("ok"))
                top3 = [c for _, c in ranked[:3]]
                second_phase = phase_b(top3)[:2] if INTERPRET else phase_b(top3)
                b = KG.compile_then_time(p, {c: kernel_fn(c, ep) for c in second_phase}, pool, deadline)
                allr = {**a, **b}
                ranked = sorted((r["us"], cfg_str(c), c) for c, r in allr.items() if r.get("ok"))
                best = ranked[0] if ranked else None
                entry = dict(shape=[n_out, n_in], epilogue=ep, M=M,
                             top=[dict(cfg=dataclasses.asdict(c), us=us) for us, _, c in ranked[:5]],
                             failed=sum(1 for r in allr.values() if not r.get("ok")))
                results["sweep"].append(entry)
                if best:
                    log(f"sweep {n_out}x{n_in} {ep} M={M}: best {best[1]} {best[0]:.2f} us "
                        f"({speed(p, best[0], bw)[0]}); top5 " +
                        " ".join(f"{s}:{u:.1f}" for u, s, _ in ranked[:5]))
                del p
    deadline = float("inf")
    for model in models:
        for n_out, n_in, ep in SHAPES[model]:
            for M in MS:
                p = problem(n_out, n_in, M, ep)
                cfg = SG.choose_config(M, n_out, n_in, ep)
                r = KG.compile_then_time(p, {"xla": xla_fn(ep), "kernel": kernel_fn(cfg, ep)}, pool, deadline)
                row = dict(model=model, shape=[n_out, n_in], epilogue=ep, M=M, cfg=dataclasses.asdict(cfg), **{
                    f"{k}_{f}": v for k, d in r.items() for f, v in d.items()})
                results["rows"].append(row)
                log(f"{model} {n_out}x{n_in} {ep} M={M}: " + ", ".join(
                    f"{k} {d['us']:.2f} us" if d.get("ok") else f"{k} FAILED {d.get('error', d.get('err'))}"
                    for k, d in r.items()))
                del p
    pool.shutdown()
    what, ceiling = "Batched-decode projections", f"HBM read {bw / 1e12:.2f} TB/s"
    print(f"\n{what}, bf16, on {dev.device_kind}, jax {jax.__version__}; {ceiling}")
    print("| model | N x K | epilogue | M | config | kernel us | kernel share | XLA us | XLA share | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        p = KG.Problem(r["shape"][0], r["shape"][1], r["M"], (), (), [])
        k_ok, x_ok = r.get("kernel_ok"), r.get("xla_ok")
        ks = f"{r['kernel_us']:.2f} | {speed(p, r['kernel_us'], bw)[1]:.0%}" if k_ok else "failed | "
        xs = f"{r['xla_us']:.2f} | {speed(p, r['xla_us'], bw)[1]:.0%}" if x_ok else "failed | "
        sp = f"{r['xla_us'] / r['kernel_us']:.2f}x" if k_ok and x_ok else ""
        print(f"| {r['model']} | {r['shape'][0]} x {r['shape'][1]} | {r['epilogue']} | {r['M']} | "
              f"{cfg_str(SG.SkinnyConfig(**r['cfg']))} | {ks} | {xs} | {sp} |")
    if args.sweep:
        results["winners"] = sweep_winners(results)
        for w in results["winners"]:
            print(f"# table row: {w['shape'][0]} x {w['shape'][1]} {w['epilogue']} M={w['M']}: "
                  f"{cfg_str(SG.SkinnyConfig(**w['cfg']))} {w['us']:.2f} us against XLA {w['xla_us']:.2f}")
    print(f"total {time.time() - t_start:.0f} s")
    save_results(results, "skinny_norm_gemm.json" if NORM else "skinny_gemm.json")


if __name__ == "__main__":
    main()
