"""The Mosaic GPU GEMM (pallas/hopper_gemm.py) on batched-decode rows, against what the engine runs there.

    PYTHONPATH=. python3 bench/kernels_hopper_skinny.py --shape qwen3-4b [--rows 8 16 32 64]
    (CPU dry run: --interpret --shape tiny --layers 2)

A decode step at batch 2-64 reads each weight matrix once for all its rows: the products are bound by the
weight stream, not the tensor cores. The engine runs them on the Pallas Triton skinny GEMM where its table
has the shape (pallas/skinny_gemm.py), else XLA's GEMM. The Mosaic kernel streams weight tiles by TMA
through a deep shared-memory ring; with `split_n` its two compute warpgroups share one x tile of
tile_m = 64 rows (the batch, padded: wgmma's smallest M) and take half the CTA's columns each. Its time
does not depend on the batch (always 64 rows), so it is timed once per projection, on x padded outside
the timed call (in the engine the pad would fuse into the norm before QKV and gate/up, and would be a
kernel of its own before o_proj). Each product over `--layers` distinct matrices (more bytes than L2
holds), us a call, and as a share of the HBM read ceiling measured in the same run (weight bytes only).
JSON to $OUT/kernels_hopper_skinny.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import hbm_read_ceiling
from bench.kernel_timing import best_ms_per_call, log, rel_err
from bench.kernels_hopper_gemm import RIGHT, TIMING, dry_run_timing, over_layers, projections, time_config, xla_op
from jaxinfer.pallas import skinny_gemm
from jaxinfer.pallas.hopper_gemm import HopperConfig, supported

ROWS = 64   # the padded batch: one warpgroup tile
CONFIGS = [HopperConfig(64, tn, 64, stages, epi_n=min(tn, 64), split_n=True)
           for tn, stages in ((16, 6), (16, 8), (32, 6), (32, 8), (64, 4))]
# K split in 2 or 4 (float32 partials summed by XLA): o_proj and down have 2,560 columns, 80 CTA tiles at 32
# columns, so without a split 52 of the 132 SMs stream nothing (not with swiglu: skipped there)
CONFIGS += [HopperConfig(64, tn, 64, 6, epi_n=tn, split_n=True, split_k=sk) for tn in (16, 32) for sk in (2, 4)]


def patch_decode_table(path: str, rows: int | None = None) -> list[str]:
    """For the step's A/B: each product this bench timed (its JSON) into hopper_gemm.DECODE_TABLE at the config
    that ran fastest and right; with `rows`, only the products where that beat the engine's kernel at those rows
    in the same run. Returns what it patched."""
    from jaxinfer.pallas import hopper_gemm

    fastest: dict = {}
    engine: dict = {}
    for r in json.load(open(path))["results"]:
        key = (r["N"], r["K"], r["epilogue"])
        if r["kernel"] == "mosaic" and r["rel_err"] < RIGHT and (key not in fastest or r["us"] < fastest[key]["us"]):
            fastest[key] = r
        if r["kernel"].startswith("engine") and r["M"] == rows:
            engine[key] = r["us"]
    patched = []
    for key, r in fastest.items():
        if rows is not None and not r["us"] < engine.get(key, 0.0):
            continue
        hopper_gemm.DECODE_TABLE[key] = HopperConfig(**r["config"])
        patched.append(f"hopper decode {key[0]} x {key[1]} {key[2]}")
        print(f"# hopper decode table: {key}: {hopper_gemm.DECODE_TABLE[key]} ({r['us']:.2f} us)", flush=True)
    return patched


def engine_op(M: int, N: int, K: int, epilogue: str, interpret: bool = False):
    """What the engine runs for M rows of this product: the skinny GEMM at its table's config (at every shape
    in interpret mode, as the ops do), else XLA."""
    cfg = skinny_gemm.choose_config(M, N, K, epilogue) if interpret else skinny_gemm.table_config(M, N, K, epilogue)
    if cfg is None:
        return "XLA", xla_op(epilogue)
    return "skinny", lambda x, w, r: skinny_gemm.skinny_gemm(
        x, w, residual=r if epilogue == "residual" else None, epilogue=epilogue, config=cfg, interpret=interpret)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (use --shape tiny)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ip = args.interpret
    configs = [HopperConfig(64, 16, 64, 2, epi_n=16, split_n=True)] if ip else CONFIGS
    bw = 1e11 if ip else hbm_read_ceiling()
    if ip:
        dry_run_timing()
    log(f"# HBM read ceiling {bw / 1e12:.2f} TB/s; {jax.devices()[0].device_kind}")
    results, table = [], []

    def save() -> None:   # after each projection's sweep and rows: kept if a step times out
        with open(os.path.join(args.out, "kernels_hopper_skinny.json"), "w") as f:
            json.dump(dict(shape=args.shape, hbm_read=bw, results=results), f, indent=1)

    for name, N, K, epilogue in projections(args.shape):
        cols = N // 2 if epilogue == "swiglu" else N
        keys = jax.random.split(jax.random.key(hash(name) % 2**31), 3)
        ws = tuple((jax.random.normal(k, (N, K), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
                   for k in jax.random.split(keys[0], args.layers))
        x64 = jax.random.normal(keys[1], (ROWS, K), jnp.bfloat16)
        r64 = jax.random.normal(keys[2], (ROWS, cols), jnp.bfloat16)
        bytes_ = N * K * 2

        def share(ms, bytes_=bytes_):    # bound now: the closing table calls it after the loop
            return bytes_ / (ms / 1e3) / bw

        (ref, *_), _ = best_ms_per_call(over_layers(xla_op(epilogue), args.layers), (x64, ws, r64), args.layers,
                                        repeats=1)
        best = None
        for cfg in configs:
            if not supported(ROWS, N, K, epilogue, cfg):
                continue
            timed = time_config(cfg, epilogue, (x64, ws, r64), args.layers, f"{name} ", interpret=ip,
                                sms=4 if ip else None)
            if timed is None:
                continue
            (y, *_), ms = timed
            err = rel_err(y, ref)
            log(f"  {name} Mosaic {cfg.tile_n}x2/{cfg.stages}/k{cfg.split_k}: {1e3 * ms:.2f} us "
                f"({100 * share(ms):.1f}% of the read ceiling), rel err {err:.2e}")
            results.append(dict(name=name, N=N, K=K, epilogue=epilogue, M=ROWS, kernel="mosaic", config=cfg.__dict__,
                                us=1e3 * ms, share=share(ms), rel_err=err))
            if err < RIGHT and (best is None or ms < best[1]):
                best = (cfg, ms)
        save()
        for M in args.rows:
            x, r = x64[:M], r64[:M]
            kind, op = engine_op(M, N, K, epilogue, ip)
            _, xla_ms = best_ms_per_call(over_layers(xla_op(epilogue), args.layers), (x, ws, r), args.layers, **TIMING)
            _, eng_ms = best_ms_per_call(over_layers(op, args.layers), (x, ws, r), args.layers, **TIMING)
            log(f"{name} M={M}: XLA {1e3 * xla_ms:.2f} us, engine ({kind}) {1e3 * eng_ms:.2f} us")
            results.append(dict(name=name, N=N, K=K, epilogue=epilogue, M=M, kernel="xla", us=1e3 * xla_ms,
                                share=share(xla_ms)))
            results.append(dict(name=name, N=N, K=K, epilogue=epilogue, M=M, kernel=f"engine-{kind}",
                                us=1e3 * eng_ms, share=share(eng_ms)))
            table.append((name, M, xla_ms, kind, eng_ms, best, share))
        save()
    print(f"\n{args.shape}, HBM read ceiling {bw / 1e12:.2f} TB/s ({time.strftime('%Y-%m-%d')}); us a call, share of "
          "the read ceiling (weight bytes)")
    print("| projection | rows | XLA | engine | engine's kernel | Mosaic (64 rows) | config |")
    print("|---|---|---|---|---|---|---|")
    for name, M, xla_ms, kind, eng_ms, best, share in table:
        mosaic = "-" if best is None else f"{1e3 * best[1]:.2f} ({100 * share(best[1]):.0f}%)"
        config = "-" if best is None else f"{best[0].tile_n}x2/{best[0].stages}/k{best[0].split_k}"
        print(f"| {name} | {M} | {1e3 * xla_ms:.2f} ({100 * share(xla_ms):.0f}%) | {1e3 * eng_ms:.2f} "
              f"({100 * share(eng_ms):.0f}%) | {kind} | {mosaic} | {config} |")


if __name__ == "__main__":
    main()
