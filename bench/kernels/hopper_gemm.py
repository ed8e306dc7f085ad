"""The Mosaic GPU prompt-row GEMM (jaxinfer/pallas/hopper_gemm.py) against XLA's GEMM (cuBLAS) plus its
epilogue in XLA, at a model's prefill projections, on the H200.

    PYTHONPATH=. python3 bench/kernels/hopper_gemm.py --shape qwen3-4b --rows 1024 8192
    PYTHONPATH=. python3 bench/kernels/hopper_gemm.py --shape qwen3-4b --rows 1024 8192 --w8a8 fp8
    (CPU dry run: --interpret --shape tiny --rows 128 --layers 2 --configs best)

--w8a8 int8|fp8: the weights quantized a channel at a time, and the kernel's W8A8 form (x's rows quantized in the
timed call, as the ops do) against XLA's W8A8 product of the same weights with the epilogue in XLA
(ops.pallas.xla_w8a8_product: the tables' FP8_W8A8_ROWS / INT8_W8A8_ROWS path), the bf16 GEMM of the same shape
timed beside both. Its JSON's "winners_8bit" are the rows where the kernel beat XLA's W8A8: bench/prefill.py
--hopper-8bit-table puts them in tables.HOPPER_GEMM_8BIT for the step's A/B.

For each projection (QKV plain, o_proj and down with the residual add, gate/up with SwiGLU) and row count:
the XLA composite's time, then each config of the kernel (errors against the XLA composite: relative
error and the share of outputs equal bit for bit), and a table of the best against XLA, in TFLOP/s and as
a share of the dense GEMM rate measured in the same run. Each call reads `--layers` distinct weight
matrices in turn, so weights come from HBM as in a prefill step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import dense_gemm_rate
from bench.kernels.kernel_timing import best_ms_per_call, log, rel_err
from jaxinfer.ops.quantized import quantize, quantize_rows
from jaxinfer.ops.twins import hopper_gemm as reference
from jaxinfer.ops.twins import hopper_gemm_w8a8 as w8a8_reference
from jaxinfer.pallas import tables
from jaxinfer.pallas.hopper_gemm import HopperConfig, hopper_gemm, supported
from bench.random_model import SHAPES

CONFIGS = [HopperConfig(64, 128, 64, 4), HopperConfig(64, 128, 64, 5), HopperConfig(64, 256, 64, 3),
           HopperConfig(128, 128, 64, 3), HopperConfig(64, 64, 64, 6), HopperConfig(128, 256, 64, 2),
           # two swizzle atoms a k step (half the waits a FLOP), and 192-wide tiles (QKV at
           # 1k: 256 CTA tiles, 1.94 waves of 132 SMs, against 384 tiles' 2.91)
           HopperConfig(64, 128, 128, 2), HopperConfig(64, 192, 64, 4)]
SWIGLU_CONFIGS = [HopperConfig(64, 128, 64, 3), HopperConfig(64, 64, 64, 5), HopperConfig(64, 64, 64, 4),
                  HopperConfig(128, 64, 64, 3), HopperConfig(128, 128, 64, 2),
                  # gate/up at 1k: 32-wide tiles make 2,432 CTA tiles (18.4 waves: the last 42% full, not 21%)
                  HopperConfig(64, 64, 128, 2), HopperConfig(64, 32, 64, 6, epi_n=32)]
# --configs table: the table's 1k configs beside neighbours (snake width, stages, epilogue width)
TABLE_NEIGHBOURS = [HopperConfig(64, 192, 64, 4), HopperConfig(64, 192, 64, 3),
                    HopperConfig(64, 192, 64, 4, snake_width=4), HopperConfig(64, 192, 64, 4, snake_width=16)]
SWIGLU_TABLE_NEIGHBOURS = [HopperConfig(64, 128, 64, 3), HopperConfig(64, 128, 64, 4),
                           HopperConfig(64, 128, 64, 3, snake_width=4), HopperConfig(64, 128, 64, 3, snake_width=16),
                           HopperConfig(64, 128, 64, 3, epi_n=128)]
# --configs best: the winners of the first sweep (H200, 2026-12-01: 1,024 and 8,192 rows)
BEST = [HopperConfig(64, 128, 64, 5), HopperConfig(64, 256, 64, 3), HopperConfig(128, 128, 64, 3)]
SWIGLU_BEST = [HopperConfig(128, 64, 64, 3), HopperConfig(64, 128, 64, 3)]
# W8A8: 128 one-byte values a k step (one 128-byte swizzled row). fp8 keeps a float32 carry beside each wgmma
# accumulator (promoted every k step), so its SwiGLU tiles (two accumulators) stay narrow.
# (fp8 on the H100, 2026-12-05: 64x256/s2 and 128x128/s2 took 2.0-2.8x the best at every shape, SwiGLU's 64x128/s3
# and 64x32/s6 1.4-2.0x; dropped so that the sweep of four products at 1k and 8k ends within its call)
W8A8_CONFIGS = [HopperConfig(64, 128, 128, 3), HopperConfig(64, 128, 128, 4), HopperConfig(64, 192, 128, 4)]
W8A8_SWIGLU_CONFIGS = [HopperConfig(64, 64, 128, 4), HopperConfig(64, 64, 128, 5)]
# a CPU dry run's W8A8 config (--interpret): 64-byte rows and 32-wide tiles divide the tiny shape
DRY_RUN_8BIT = HopperConfig(64, 32, 64, 2, epi_n=16)
# A config counts only where it matches XLA: the kernel does bit for bit where it is right, and a race shows
# as rel err ~1e-3 (H200: a wgmma group left in flight gave 4.9e-3 with 0.2% of elements off)
RIGHT = 1e-4
# W8A8 against its twin (XLA's W8A8 product, fp8 at HIGHEST precision): int8 sums are exact on both sides (the same
# bits where right); e4m3 sums are float32 in another order and grouping (the kernel promotes wgmma's accumulator every
# 128 values), so round(y) lands a bf16 step away on more outputs: ~1e-3 for a step on ~5% of them, still under a
# race's 4.9e-3. (Against XLA's default fp8 GEMM, cuBLAS's fast accumulation, every config measured 2.0-3.4e-3 with
# 68-85% of outputs equal, H100 2026-12-05: so no config counted and no row was kept.)
RIGHT_W8A8 = {"int8": 1e-4, "fp8": 1e-3}
# best_ms_per_call's options: ~0.2 s loops of each call on the GPU; one run of each in a CPU dry run (--interpret)
TIMING: dict = dict(target_s=0.2)


def patch_table(path: str) -> None:
    """For the step's A/B: each product and row count that tables.HOPPER_GEMM holds takes the config that ran
    fastest (and right) in a run of this bench (its JSON), whether or not it beat XLA there."""
    fastest: dict = {}
    for r in json.load(open(path))["results"]:
        key = (r["N"], r["K"], r["epilogue"], r["M"])
        if r["rel_err"] < RIGHT and (key not in fastest or r["us"] < fastest[key]["us"]):
            fastest[key] = r
    for (N, K, epilogue), rows in list(tables.HOPPER_GEMM.items()):
        new_rows = []
        for first, last, config in rows:
            r = fastest.get((N, K, epilogue, first)) if first == last else None
            if r is not None:
                config = HopperConfig(**r["config"])
                print(f"# hopper table: {N} x {K} {epilogue} at {first} rows: {config} ({r['us']:.1f} us)", flush=True)
            new_rows.append((first, last, config))
        tables.HOPPER_GEMM[(N, K, epilogue)] = tuple(new_rows)


def patch_table_8bit(path: str) -> None:
    """For the step's A/B: tables.HOPPER_GEMM_8BIT takes each product and row count where a --w8a8 run of this
    bench (its JSON's "winners_8bit") timed the kernel faster than XLA's W8A8 product, right."""
    data = json.load(open(path))
    for w in data.get("winners_8bit", []):
        key = (w["N"], w["K"], w["epilogue"], w.get("format", data.get("w8a8")))
        rows = tuple(r for r in tables.HOPPER_GEMM_8BIT.get(key, ()) if r[0] != w["M"])
        tables.HOPPER_GEMM_8BIT[key] = rows + ((w["M"], w["M"], HopperConfig(**w["config"])),)
        print(f"# hopper 8-bit table ({data.get('w8a8')}): {w['N']} x {w['K']} {w['epilogue']} at {w['M']} rows: "
              f"{w['config']} ({w['us']:.1f} us, XLA W8A8 {w['xla_us']:.1f})", flush=True)


def w8a8_xla_op(epilogue: str):
    """XLA's W8A8 product of the quantized weights (x's rows quantized in it) and the epilogue in XLA, as the ops
    run it (fp8: cuBLAS's fast accumulation); the errors are taken against the kernel's twin (fp8 sums in float32)."""
    return lambda x, q, r: w8a8_reference(x, q, r if epilogue == "residual" else None, epilogue, precise=False)


def w8a8_kernel_op(cfg: HopperConfig, epilogue: str, **kw):
    """The kernel in W8A8 as ops.pallas._hopper calls it: x's rows quantized, then the kernel."""
    def op(x, q, r):
        xq, xs = quantize_rows(x, q.dtype)
        return hopper_gemm(xq, q.values, residual=r if epilogue == "residual" else None, epilogue=epilogue,
                           x_scale=xs, w_scale=q.scale, out_dtype=x.dtype, config=cfg, **kw)
    return op


def projections(shape: str) -> list[tuple[str, int, int, str]]:
    c = SHAPES[shape]
    d, i, h = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    hd = c.get("head_dim", d // h)
    kv = c["num_key_value_heads"]
    return [("qkv", (h + 2 * kv) * hd, d, "none"), ("o_proj", d, h * hd, "residual"),
            ("gate_up", 2 * i, d, "swiglu"), ("down", d, i, "residual")]


def xla_op(epilogue: str):
    """XLA's GEMM and the epilogue in XLA: the kernel's reference twin."""
    return lambda x, w, r: reference(x, w, r if epilogue == "residual" else None, epilogue)


def over_layers(op, layers: int):
    """A jit calling op once per weight matrix (each its own HBM read); it returns every output (so none
    is dead code). ws is a tuple of separate arrays, as the engine's step holds its layers (a stacked array
    sliced here made XLA run ~50% slower than in the step's trace)."""
    def f(x, ws, r):
        return tuple(op(x, ws[layer], r) for layer in range(layers))
    return jax.jit(f)


def dry_run_timing() -> None:
    """A CPU dry run (--interpret) times each call once: interpret mode takes seconds a call."""
    TIMING.clear()
    TIMING.update(repeats=1)


def time_config(cfg: HopperConfig, epilogue: str, args: tuple, layers: int, label: str = "", w8a8: bool = False,
                **kw):
    """(outputs, ms a call) of the kernel at cfg over `layers` weight matrices (args: x, ws, r; w8a8: ws quantized,
    the kernel's W8A8 form), or None where it failed to build or run (a config the SM cannot hold: reported, and the
    sweep goes on)."""
    def op(x, w, r):
        return hopper_gemm(x, w, residual=r if epilogue == "residual" else None, epilogue=epilogue, config=cfg, **kw)

    if w8a8:
        op = w8a8_kernel_op(cfg, epilogue, **kw)

    try:
        return best_ms_per_call(over_layers(op, layers), args, layers, **TIMING)
    except Exception as e:  # noqa: BLE001
        log(f"  {label}{cfg}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1024])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--only", nargs="*", default=None, help="projection names to run")
    ap.add_argument("--configs", choices=("all", "best", "table"), default="all")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (use --shape tiny --rows 128)")
    ap.add_argument("--w8a8", choices=("int8", "fp8"), default=None,
                    help="weights of this format: the kernel's W8A8 form against XLA's W8A8 product")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    kw = dict(interpret=True, sms=4) if args.interpret else {}
    if args.interpret:
        dry_run_timing()
    rate = 1e12 if args.interpret else dense_gemm_rate()
    log(f"# dense GEMM rate {rate / 1e12:.0f} TFLOP/s; {jax.devices()[0].device_kind}")
    rows_out, results, winners = [], [], []
    json_name = "kernels_hopper_gemm_w8a8.json" if args.w8a8 else "kernels_hopper_gemm.json"
    for name, N, K, epilogue in projections(args.shape):
        if args.only and name not in args.only:
            continue
        keys = jax.random.split(jax.random.key(hash(name) % 2**31), 3)
        ws = tuple((jax.random.normal(k, (N, K), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
                   for k in jax.random.split(keys[0], args.layers))
        qs = tuple(quantize(w.astype(jnp.float32), args.w8a8) for w in ws) if args.w8a8 else None
        for M in args.rows:
            cols = N // 2 if epilogue == "swiglu" else N
            x = jax.random.normal(keys[1], (M, K), jnp.bfloat16)
            r = jax.random.normal(keys[2], (M, cols), jnp.bfloat16)
            flops = 2 * M * N * K
            (ref, *_), xla_ms = best_ms_per_call(over_layers(xla_op(epilogue), args.layers), (x, ws, r), args.layers,
                                                 **TIMING)
            log(f"{name} M={M}: XLA {1e3 * xla_ms:.1f} us ({flops / xla_ms / 1e9:.0f} TFLOP/s)")
            bf16_ms = None
            if qs is not None:      # the kernel is judged against XLA's W8A8 product; bf16 stays beside it
                bf16_ms = xla_ms
                (xla_y, *_), xla_ms = best_ms_per_call(over_layers(w8a8_xla_op(epilogue), args.layers), (x, qs, r),
                                                       args.layers, **TIMING)
                ref = w8a8_reference(x, qs[0], r if epilogue == "residual" else None, epilogue)
                log(f"{name} M={M}: XLA {args.w8a8} W8A8 {1e3 * xla_ms:.1f} us ({flops / xla_ms / 1e9:.0f} TFLOP/s), "
                    f"rel err {rel_err(xla_y, ref):.2e} against the twin (fp8 sums in float32)")
            best = None
            if qs is not None:
                configs = W8A8_SWIGLU_CONFIGS if epilogue == "swiglu" else W8A8_CONFIGS
                configs = configs + [DRY_RUN_8BIT] if args.interpret else configs
            elif args.configs == "best":
                configs = SWIGLU_BEST if epilogue == "swiglu" else BEST
            elif args.configs == "table":
                configs = SWIGLU_TABLE_NEIGHBOURS if epilogue == "swiglu" else TABLE_NEIGHBOURS
            else:
                configs = SWIGLU_CONFIGS if epilogue == "swiglu" else CONFIGS
            for cfg in configs:
                if not supported(M, N, K, epilogue, cfg):
                    continue
                timed = time_config(cfg, epilogue, (x, qs if qs is not None else ws, r), args.layers,
                                    w8a8=qs is not None, **kw)
                if timed is None:
                    continue
                (y, *_), ms = timed
                err = rel_err(y, ref)
                same = float(np.mean(np.asarray(y) == np.asarray(ref)))
                log(f"  {cfg}: {1e3 * ms:.1f} us ({flops / ms / 1e9:.0f} TFLOP/s), rel err {err:.2e}, equal {same:.4f}")
                results.append(dict(name=name, M=M, N=N, K=K, epilogue=epilogue, config=cfg.__dict__, us=1e3 * ms,
                                    xla_us=1e3 * xla_ms, rel_err=err, equal=same,
                                    **(dict(format=args.w8a8, bf16_xla_us=1e3 * bf16_ms) if qs is not None else {})))
                if err < (RIGHT_W8A8[args.w8a8] if qs is not None else RIGHT) and (best is None or ms < best[1]):
                    best = (cfg, ms, err, same)
                    if qs is not None and ms < xla_ms:      # this product's row: the fastest right config so far
                        winners = [w for w in winners if (w["N"], w["K"], w["epilogue"], w["M"]) != (N, K, epilogue, M)]
                        winners.append(results[-1])
                with open(os.path.join(args.out, json_name), "w") as f:   # kept if a step times out
                    json.dump(dict(shape=args.shape, gemm_rate=rate, w8a8=args.w8a8, results=results,
                                   winners_8bit=winners), f, indent=1)
            rows_out.append((name, M, xla_ms, best, flops, bf16_ms))
    xla_name = f"XLA {args.w8a8} W8A8" if args.w8a8 else "XLA"
    print(f"\n{args.shape}{', ' + args.w8a8 + ' W8A8' if args.w8a8 else ''}, dense GEMM rate {rate / 1e12:.0f} "
          f"TFLOP/s ({time.strftime('%Y-%m-%d')})")
    print(f"| projection | rows | {xla_name} + epilogue us | TFLOP/s | Mosaic GEMM us | TFLOP/s | share of GEMM rate | "
          "rel err | equal | config | XLA bf16 us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, M, xla_ms, best, flops, bf16_ms in rows_out:
        bf16 = "-" if bf16_ms is None else f"{1e3 * bf16_ms:.1f}"
        if best is None:
            print(f"| {name} | {M} | {1e3 * xla_ms:.1f} | {flops / xla_ms / 1e9:.0f} | - | - | - | - | - | - | {bf16} |")
            continue
        cfg, ms, err, same = best
        print(f"| {name} | {M} | {1e3 * xla_ms:.1f} | {flops / xla_ms / 1e9:.0f} | {1e3 * ms:.1f} | "
              f"{flops / ms / 1e9:.0f} | {100 * flops / (ms / 1e3) / rate:.1f}% | {err:.1e} | {same:.4f} | "
              f"{cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k}/{cfg.stages} | {bf16} |")


if __name__ == "__main__":
    main()
