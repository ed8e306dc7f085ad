"""The projections of a decode step with 8-bit weights (int8, fp8 per channel, fp8 in 128x128 blocks) against bf16,
on the GPU: the batch-1 fused GEMV (pallas/fused_gemv.py with w_scale) and, with --batched, the batched-decode
tensor-core GEMM (pallas/skinny_gemm.py with w_scale) against XLA's product on the converted values.

    PYTHONPATH=. python3 bench/kernels/quantized_gemv.py [--shapes qwen3-4b llama3-8b] [--formats int8 fp8 fp8-block]
        [--sweep [--sweep-block-in 256 512 1024] [--sweep-rows 1 2] [--sweep-warps 1]] [--no-gemv] [--batched 16 64] [--batched-sweep]
        [--budget 240] [--prompt 1024 8192] [--fp8-rows 16 64 1024 8192] [--out DIR]

For each projection of a layer (QKV with its RMSNorm prologue, o_proj + residual, gate/up with the norm and SwiGLU,
down + residual; and the lm_head with float32 logits) it times one jit that runs the projection over every layer's
own matrix (the engine's split layers: one array a layer, L x the bytes, so every call reads HBM): the bf16 kernel
at its table's config, then each 8-bit format at its table's config (--sweep: every block_in x rows). Each output is
checked against twins.linear_8bit (bf16 rounding: 2e-2 relative). Prints us per call, the bytes a call reads (values
and scales), the share of the HBM read ceiling measured in the run (ceiling time = bytes / bandwidth), and the
speed-up over bf16; then the best 8-bit config per shape and format (rows for tables.GEMV_BLOCK_IN_8BIT,
GEMV_ROWS_8BIT, GEMV_WARPS_8BIT and, from the int8 rows, GEMV_INT8_CONVERT_BY_SHAPE) and the layer's sum.

--batched M...: the same projections at M rows (a batched decode step): XLA's products (reference.linear on the
QuantizedWeight: values converted to bf16 in the GEMM's fusion, scale after; block scales dequantized; and, per
channel, its W8A8 product) against the skinny kernel at skinny_gemm.choose_config, each config also in W8A8 (x's rows
quantized to the weights' format, 8-bit tile products; checked against XLA's W8A8) (--batched-sweep: phase A of
bench/kernels/skinny_gemm.py's configs); prints rows for tables.SKINNY_GEMM_8BIT where the kernel beat XLA's best
by 3%.

--prompt M...: prompt rows (XLA's GEMMs, 4 layers' matrices a call): bf16 weights (reference.linear) against each
format's XLA product as ops.pallas runs it (ops.pallas._xla_product: converted values, or block-scaled ones
dequantized) and, for fp8 per channel, W8A8 on fp8 tensor cores (ops.pallas.w8a8_product): what sets
tables.FP8_W8A8_ROWS.

--fp8-rows M...: fp8 per-channel weights at batched-decode and prompt rows, every product ops.pallas can run against
bf16 as it routes it (bench/kernels/fp8_rows.py; --batched-sweep sweeps the skinny kernel's configs within --budget);
prints the best per (shape, projection, M) and the rows of tables.SKINNY_GEMM_8BIT and FP8_W8A8_ROWS to paste.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.ceilings import hbm_read_ceiling
from bench.kernels.kernel_timing import best_ms_per_call, log, rel_err
from bench.random_model import SHAPES
from bench.table import print_table
from jaxinfer.ops import reference, twins
from jaxinfer.ops.quantized import QuantizedWeight, quantize_rows
from jaxinfer.pallas import skinny_gemm as SG
from jaxinfer.pallas.fused_gemv import block_in_for, fused_gemv, int8_convert_for, rows_for, warps_for

f32, bf16 = jnp.float32, jnp.bfloat16
FORMATS = {"int8": (jnp.int8, None), "fp8": (jnp.float8_e4m3fn, None), "fp8-block": (jnp.float8_e4m3fn, (128, 128))}
TOL = 2e-2
INTERPRET = False


def projections(cfg: dict) -> list[tuple[str, int, int, str, bool]]:
    """(name, weight rows, in, epilogue, norm prologue) of each decode projection of a layer, then the lm_head."""
    D, I = cfg["hidden_size"], cfg["intermediate_size"]
    H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or D // H
    return [("qkv", (H + 2 * K) * hd, D, "none", True), ("o_proj", D, H * hd, "residual", False),
            ("gate/up", 2 * I, D, "swiglu", True), ("down", D, I, "residual", False),
            ("lm_head", cfg["vocab_size"], D, "logits", False)]


def random_8bit(key, n: int, k: int, fmt: str) -> QuantizedWeight:
    """Values over the format's range and scales that make the matrix ~N(0, 0.02^2): the bytes of a real one."""
    dtype, block = FORMATS[fmt]
    kv, ks = jax.random.split(key)
    if dtype == jnp.int8:
        values = jax.random.randint(kv, (n, k), -127, 128).astype(jnp.int8)
    else:
        values = jnp.clip(jax.random.normal(kv, (n, k)) * 150, -448, 448).astype(dtype)
    top = 127.0 if dtype == jnp.int8 else 448.0
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scale = jax.random.uniform(ks, shape, f32, 0.5, 1.5) * (0.06 / top)
    return QuantizedWeight(values, scale, block)


def nbytes(w) -> int:
    return w.values.nbytes + w.scale.nbytes if isinstance(w, QuantizedWeight) else w.nbytes


def gemv_call(epilogue: str, norm: bool, block_in: int, rows: int, convert: str | None = None, warps: int = 1):
    """f(x, ws, scale, res) running the engine's GEMV over every layer's matrix in ws (8-bit or bf16)."""
    def f(x, ws, scale, res):
        outs = []
        for w in ws:
            quant = dict(w_scale=w.scale[None], w_block=w.block) if isinstance(w, QuantizedWeight) else {}
            values = w.values if isinstance(w, QuantizedWeight) else w
            kw = dict(out_dtype=f32) if epilogue == "logits" else dict(epilogue=epilogue)
            if epilogue == "residual":
                kw["residual"] = res
            if convert is not None:
                kw["int8_convert"] = convert
            outs.append(fused_gemv(x, values[None], 0, scale=scale if norm else None, block_in=block_in, rows=rows,
                                   num_warps=warps, interpret=INTERPRET, **quant, **kw))
        return outs
    return jax.jit(f)


def twin(x, w, epilogue, norm, scale, res):
    kw = dict(out_dtype=f32) if epilogue == "logits" else dict(epilogue=epilogue)
    if epilogue == "residual":
        kw["residual"] = res
    return twins.linear_8bit(x, w, scale=scale if norm else None, **kw)


SWEEP_BLOCK_IN = (256, 512, 1024)
SWEEP_ROWS = (1, 2)
SWEEP_WARPS = (1,)
SWEEP_CONVERTS = ("bits", "cvt", "prmt")


def gemv_configs(n: int, k: int, fmt: str, sweep: bool) -> list[tuple[int, int, str | None, int]]:
    """(block_in, rows, int8 conversion, warps) to time: the table's, or with --sweep every block_in x rows x warps the
    format allows (int8: with each conversion; warps only where each lane still loads 16 bytes or fewer)."""
    dtype, block = FORMATS[fmt]
    converts = list(SWEEP_CONVERTS) if dtype == jnp.int8 else [None]
    table = (block_in_for(n, k, dtype, block), rows_for(n, k, dtype), int8_convert_for(n, k) if converts[0] else None,
             warps_for(n, k, dtype))
    if not sweep:
        return [table]
    block_ins = [b for b in SWEEP_BLOCK_IN if block is None or block[1] % b == 0 or b % block[1] == 0]
    cfgs = [(b, r, c, nw) for b in block_ins for r in SWEEP_ROWS if n % r == 0 for c in converts
            for nw in SWEEP_WARPS if b // (32 * nw) >= 4]
    return [table] + [c for c in cfgs if c != table]


def time_gemv(shape: str, cfg: dict, formats: list[str], sweep: bool, L: int, ceiling: float, out: list) -> None:
    for name, n, k, epilogue, norm in projections(cfg):
        layers = 1 if epilogue == "logits" else L
        keys = jax.random.split(jax.random.PRNGKey(n + k), 4)
        x = jax.random.normal(keys[1], (1, k), bf16)
        scale = (1 + 0.1 * jax.random.normal(keys[2], (k,), f32)).astype(bf16)
        res = jax.random.normal(keys[3], (1, n), bf16)
        rows_n = n // 2 if epilogue == "swiglu" else n
        bf_ws = [(0.02 * jax.random.normal(kk, (n, k), f32)).astype(bf16) for kk in jax.random.split(keys[0], layers)]
        f = gemv_call(epilogue, norm, block_in_for(rows_n, k, bf16), rows_for(rows_n, k))
        _, ms = best_ms_per_call(f, (x, bf_ws, scale, res), layers, 3, target_s=0.25)
        base_us = 1e3 * ms
        record(out, shape, name, n, k, "bf16", "table", base_us, nbytes(bf_ws[0]), ceiling, base_us, "")
        del bf_ws
        for fmt in formats:
            ws = [random_8bit(kk, n, k, fmt) for kk in jax.random.split(keys[0], layers)]
            ref = twin(x, ws[0], epilogue, norm, scale, res)
            for block_in, rows, convert, warps in gemv_configs(rows_n, k, fmt, sweep):
                label = f"block_in {block_in}, rows {rows}" + (f", {convert}" if convert else "") + \
                    (f", {warps} warps" if warps > 1 else "")
                try:
                    f = gemv_call(epilogue, norm, block_in, rows, convert, warps)
                    outs, ms = best_ms_per_call(f, (x, ws, scale, res), layers, 3, target_s=0.25)
                    err = rel_err(outs[0], ref)
                    record(out, shape, name, n, k, fmt, label, 1e3 * ms, nbytes(ws[0]), ceiling, base_us,
                           f"{err:.1e}" + ("" if err <= TOL else " FAIL"))
                except Exception as e:   # a config that does not compile is reported, not fatal
                    out.append(dict(shape=shape, projection=name, format=fmt, config=label, error=str(e)[:200]))
                    log(f"# {shape} {name} {fmt} {label}: {type(e).__name__}: {str(e)[:200]}")
            del ws


def record(out, shape, name, n, k, fmt, config, us, nb, ceiling, base_us, err) -> None:
    row = dict(shape=shape, projection=name, dims=f"{n}x{k}", format=fmt, config=config, us=us, mb=nb / 1e6,
               ceiling_us=1e6 * nb / ceiling, share=nb / (us * 1e-6) / ceiling, speedup=base_us / us, err=err)
    out.append(row)
    log(json.dumps(row))


def best_rows(rows: list[dict]) -> list[dict]:
    """The fastest checked config per (shape, projection, format)."""
    best = {}
    for r in rows:
        if "error" in r or r["format"] == "bf16" or "FAIL" in r["err"]:
            continue
        key = (r["shape"], r["projection"], r["format"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return list(best.values())


def layer_sums(rows: list[dict], formats: list[str]) -> list[dict]:
    """A layer's four projections (not the lm_head) at bf16 and at each format's best config: us, and the share of
    the bytes' ceiling."""
    out = []
    bests = best_rows(rows)
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for fmt in ["bf16"] + formats:
            src = [r for r in (rows if fmt == "bf16" else bests) if r.get("format") == fmt and r["shape"] == shape
                   and r["projection"] != "lm_head" and "error" not in r]
            if len(src) == 4:
                us, cus = sum(r["us"] for r in src), sum(r["ceiling_us"] for r in src)
                out.append(dict(shape=shape, format=fmt, us=us, ceiling_us=cus, share=cus / us))
    return out


# --- batched decode rows ------------------------------------------------------------------------------------------

def batched_call(fn, epilogue: str):
    def f(x, ws, res):
        return [fn(x, w, res) for w in ws]
    return jax.jit(f)


def xla_product(epilogue):
    def fn(x, w, res):
        y = reference.linear(x, w)
        return reference.swiglu(y) if epilogue == "swiglu" else res + y if epilogue == "residual" else y
    return fn


def xla_w8a8_product(epilogue, precise: bool = False):
    """ops.pallas's XLA W8A8 product (each row of x in the weights' format), the epilogue as the reference ops;
    precise: fp8 sums in float32 (the kernels' twin), else as the ops run it (cuBLAS's fast accumulation)."""
    from jaxinfer.ops.pallas import xla_w8a8_product as product

    def fn(x, w, res):
        y = product(x, w, precise=precise).astype(x.dtype)
        return reference.swiglu(y) if epilogue == "swiglu" else res + y if epilogue == "residual" else y
    return fn


def skinny_product(cfg, epilogue):
    """The skinny kernel at cfg; cfg.w8a8: x's rows quantized first (quantize_rows, timed with the kernel)."""
    def fn(x, w, res):
        kw = dict(residual=res) if epilogue == "residual" else {}
        if cfg.w8a8:
            x_bf16 = x
            x, x_scale = quantize_rows(x_bf16, w.dtype)
            kw.update(x_scale=x_scale, out_dtype=x_bf16.dtype)
        return SG.skinny_gemm(x, w.values[None], 0, w_scale=w.scale[None], w_block=w.block, config=cfg,
                              epilogue=epilogue, interpret=INTERPRET, **kw)
    return fn


def sweep_configs(K: int) -> list[SG.SkinnyConfig]:
    """bench/kernels/skinny_gemm.py's phase A."""
    return [SG.SkinnyConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=4, split_k=s)
            for bn in (32, 64, 128) for bk in (64, 128, 256) for s in (1, 2, 4, 8) if s == 1 or -(-K // bk) >= 2 * s]


def time_batched(shape: str, cfg: dict, formats: list[str], Ms: list[int], sweep: bool, L: int, ceiling: float,
                 deadline: float, out: list) -> None:
    """Each (projection, format, M) sweeps for an equal share of the time left before `deadline`, W8A8 configs
    first (the converted tiles' configs measured slower than XLA at 64 rows, 2026-12-03)."""
    todo = [(name, n, k, epilogue) for name, n, k, epilogue, _ in projections(cfg) if epilogue != "logits"]
    cases_left = len(todo) * len(formats) * len(Ms)
    for name, n, k, epilogue in todo:
        keys = jax.random.split(jax.random.PRNGKey(n + k), 3)
        for fmt in formats:
            ws = [random_8bit(kk, n, k, fmt) for kk in jax.random.split(keys[0], L)]
            for M in Ms:
                until = time.time() + max(0.0, deadline - time.time()) / cases_left   # this case's share
                cases_left -= 1
                x = jax.random.normal(keys[1], (M, k), bf16)
                res = jax.random.normal(keys[2], (M, n), bf16)
                ref = twins.linear_8bit(x, ws[0], residual=res, epilogue="none" if epilogue == "none" else epilogue)
                per_channel = ws[0].block is None
                # W8A8 (per-channel weights): checked against XLA's W8A8 product of the same quantized rows, fp8
                # sums in float32 as the kernel's (the xla-w8a8 row's own error shows fast accumulation's)
                ref_w8a8 = xla_w8a8_product(epilogue, precise=True)(x, ws[0], res) if per_channel else None
                cands = {"xla": xla_product(epilogue)} | ({"xla-w8a8": xla_w8a8_product(epilogue)} if per_channel
                                                          else {})
                cfgs = [SG.choose_config(M, n, k, epilogue)]
                if per_channel:   # each config also in W8A8, right after it
                    cfgs.append(dataclasses.replace(cfgs[0], w8a8=True))
                if sweep and time.time() < until:
                    more = [c for c in sweep_configs(k) if c not in cfgs]
                    cfgs += [dataclasses.replace(c, w8a8=True) for c in more] if per_channel else []
                    cfgs += more
                cands.update({c: skinny_product(c, epilogue) for c in cfgs})
                for label, fn in cands.items():
                    if not str(label).startswith("xla") and time.time() > until and label not in cfgs[:2]:
                        break
                    w8a8 = label == "xla-w8a8" or getattr(label, "w8a8", False)
                    try:
                        outs, ms = best_ms_per_call(batched_call(fn, epilogue), (x, ws, res), L, 3, target_s=0.15)
                        err = rel_err(outs[0], ref_w8a8 if w8a8 else ref)
                    except Exception as e:
                        log(f"# {shape} {name} {fmt} M={M} {label}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    nb = nbytes(ws[0])
                    row = dict(shape=shape, projection=name, dims=f"{n}x{k}", epilogue=epilogue, format=fmt, M=M,
                               kernel=label if isinstance(label, str) else "skinny-w8a8" if w8a8 else "skinny",
                               config="" if isinstance(label, str) else dataclasses.astuple(label), us=1e3 * ms,
                               share=nb / (ms * 1e-3) / ceiling, err=f"{err:.1e}" + ("" if err <= TOL else " FAIL"))
                    out.append(row)
                    log(json.dumps(row))
            del ws


def batched_winners(rows: list[dict], margin: float = 0.97) -> list[dict]:
    """Per (dims, epilogue, format, M): the fastest checked skinny config where it beat XLA by `margin`."""
    out = []
    keys = dict.fromkeys((r["dims"], r["epilogue"], r["format"], r["M"]) for r in rows)
    for key in keys:
        group = [r for r in rows if (r["dims"], r["epilogue"], r["format"], r["M"]) == key and "FAIL" not in r["err"]]
        xla = sorted((r for r in group if r["kernel"].startswith("xla")), key=lambda r: r["us"])
        kern = sorted((r for r in group if r["kernel"].startswith("skinny")), key=lambda r: r["us"])
        if xla and kern:
            out.append(dict(dims=key[0], epilogue=key[1], format=key[2], M=key[3], xla=xla[0]["kernel"],
                            xla_us=xla[0]["us"], us=kern[0]["us"], kernel=kern[0]["kernel"],
                            config=str(kern[0]["config"]), cfg=list(kern[0]["config"]),
                            keep="yes" if kern[0]["us"] < margin * xla[0]["us"] else "no"))
    return out


def table_rows(winners: list[dict]) -> list[dict]:
    """The kept winners as rows of tables.SKINNY_GEMM_8BIT (bench/throughput.py --skinny-table reads them)."""
    fields = [f.name for f in dataclasses.fields(SG.SkinnyConfig)]
    return [dict(shape=[int(d) for d in w["dims"].split("x")], epilogue=w["epilogue"], M=w["M"], format=w["format"],
                 cfg=dict(zip(fields, w["cfg"]))) for w in winners if w["keep"] == "yes"]


def time_prompt(shape: str, cfg: dict, formats: list[str], Ms: list[int], out: list) -> None:
    from jaxinfer.ops import pallas as P

    L = 2 if INTERPRET else 4
    for name, n, k, epilogue, _ in projections(cfg):
        if epilogue == "logits":
            continue
        keys = jax.random.split(jax.random.PRNGKey(n + k), 2)
        bf_ws = [(0.02 * jax.random.normal(kk, (n, k), f32)).astype(bf16) for kk in jax.random.split(keys[0], L)]
        q_ws = {fmt: [random_8bit(kk, n, k, fmt) for kk in jax.random.split(keys[0], L)] for fmt in formats}
        for M in Ms:
            x = jax.random.normal(keys[1], (M, k), bf16)
            cands = [("bf16", "xla", lambda x, w: reference.linear(x, w), bf_ws, None)]
            for fmt in formats:
                ref = twins.linear_8bit(x, q_ws[fmt][0], out_dtype=f32)
                cands.append((fmt, "xla", lambda x, w: P._xla_product(x, w).astype(bf16), q_ws[fmt], ref))
                if fmt == "fp8":
                    cands.append((fmt, "w8a8", lambda x, w: P.w8a8_product(x, w).astype(bf16), q_ws[fmt], ref))
            base = None
            for fmt, how, fn, ws, ref in cands:
                try:
                    outs, ms = best_ms_per_call(jax.jit(lambda x, ws, fn=fn: [fn(x, w) for w in ws]), (x, ws), L, 3,
                                                target_s=0.15)
                except Exception as e:
                    log(f"# {shape} {name} {fmt} {how} M={M}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                us = 1e3 * ms
                base = us if fmt == "bf16" else base
                err = "" if ref is None else f"{rel_err(outs[0], ref):.1e}"
                row = dict(shape=shape, projection=name, dims=f"{n}x{k}", M=M, format=fmt, product=how, us=us,
                           tflops=2 * M * n * k / (us * 1e-6) / 1e12, speedup=(base or us) / us, err=err)
                out.append(row)
                log(json.dumps(row))
        del bf_ws, q_ws


def main() -> None:
    global INTERPRET, SWEEP_BLOCK_IN, SWEEP_ROWS, SWEEP_WARPS, SWEEP_CONVERTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3-4b", "llama3-8b"])
    ap.add_argument("--formats", nargs="+", default=["int8", "fp8", "fp8-block"], choices=list(FORMATS))
    ap.add_argument("--sweep", action="store_true", help="every block_in x rows of the GEMV")
    ap.add_argument("--sweep-block-in", type=int, nargs="+", default=list(SWEEP_BLOCK_IN))
    ap.add_argument("--sweep-rows", type=int, nargs="+", default=list(SWEEP_ROWS))
    ap.add_argument("--sweep-warps", type=int, nargs="+", default=list(SWEEP_WARPS))
    ap.add_argument("--sweep-converts", nargs="+", default=list(SWEEP_CONVERTS), choices=list(SWEEP_CONVERTS))
    ap.add_argument("--no-gemv", action="store_true", help="skip the batch-1 GEMVs (--batched / --prompt only)")
    ap.add_argument("--batched", type=int, nargs="*", default=[], help="M rows of batched decode to time")
    ap.add_argument("--batched-sweep", action="store_true", help="skinny configs beyond choose_config's")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the batched sweep")
    ap.add_argument("--prompt", type=int, nargs="*", default=[], help="prompt rows to time XLA's products at")
    ap.add_argument("--fp8-rows", type=int, nargs="*", default=[],
                    help="fp8 per-channel products at these rows: bf16 as routed, skinny 8-bit, W8A8, converted")
    ap.add_argument("--layers", type=int, default=0, help="layers (0: the model's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (use --shapes tiny)")
    args = ap.parse_args()
    INTERPRET = args.interpret
    SWEEP_BLOCK_IN, SWEEP_ROWS, SWEEP_WARPS = tuple(args.sweep_block_in), tuple(args.sweep_rows), tuple(args.sweep_warps)
    SWEEP_CONVERTS = tuple(args.sweep_converts)
    t0 = time.time()
    ceiling = 1e11 if INTERPRET else hbm_read_ceiling()
    log(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; HBM read ceiling {ceiling / 1e12:.2f} TB/s")
    gemv_rows, batched_rows, prompt_rows = [], [], []
    for shape in [] if args.no_gemv else args.shapes:
        cfg = SHAPES[shape]
        L = args.layers or cfg["num_hidden_layers"]
        time_gemv(shape, cfg, args.formats, args.sweep, L, ceiling, gemv_rows)
    deadline = time.time() + args.budget
    for shape in args.shapes if args.batched else []:
        cfg = SHAPES[shape]
        L = args.layers or cfg["num_hidden_layers"]
        time_batched(shape, cfg, args.formats, args.batched, args.batched_sweep, L, ceiling, deadline, batched_rows)
    for shape in args.shapes if args.prompt else []:
        time_prompt(shape, SHAPES[shape], args.formats, args.prompt, prompt_rows)
    fp8_rows = []
    for shape in args.shapes if args.fp8_rows else []:
        from bench.kernels import fp8_rows as F

        cfg = SHAPES[shape]
        F.time_fp8_rows(shape, cfg, args.fp8_rows, args.batched_sweep, args.layers or cfg["num_hidden_layers"],
                        args.budget, ceiling, INTERPRET, random_8bit, projections, sweep_configs, fp8_rows)

    print(f"\nbatch-1 decode GEMVs, HBM read ceiling {ceiling / 1e12:.2f} TB/s ({time.time() - t0:.0f} s)")
    print_table(gemv_rows, [("shape", "shape", ""), ("projection", "projection", ""), ("out x in", "dims", ""),
                            ("weights", "format", ""), ("config", "config", ""), ("us per call", "us", ".2f"),
                            ("MB read", "mb", ".1f"), ("ceiling us", "ceiling_us", ".2f"),
                            ("share of ceiling", "share", ".1%"), ("x bf16", "speedup", ".2f"),
                            ("rel. err vs twin", "err", "")])
    print("\nbest 8-bit config per projection (tables.GEMV_BLOCK_IN_8BIT / GEMV_ROWS_8BIT)")
    print_table(best_rows(gemv_rows), [("shape", "shape", ""), ("projection", "projection", ""), ("out x in", "dims", ""),
                                       ("weights", "format", ""), ("config", "config", ""), ("us", "us", ".2f"),
                                       ("share", "share", ".1%"), ("x bf16", "speedup", ".2f")])
    print("\na layer's four projections (best configs)")
    print_table(layer_sums(gemv_rows, args.formats), [("shape", "shape", ""), ("weights", "format", ""),
                                                      ("us", "us", ".1f"), ("ceiling us", "ceiling_us", ".1f"),
                                                      ("share", "share", ".1%")])
    if batched_rows:
        print("\nbatched decode rows: XLA's product against the skinny kernel (tables.SKINNY_GEMM_8BIT)")
        print_table(batched_winners(batched_rows), [("out x in", "dims", ""), ("epilogue", "epilogue", ""),
                                                    ("weights", "format", ""), ("M", "M", ""), ("XLA's best", "xla", ""),
                                                    ("XLA us", "xla_us", ".2f"), ("kernel", "kernel", ""),
                                                    ("kernel us", "us", ".2f"), ("config", "config", ""),
                                                    ("keep", "keep", "")])
    if prompt_rows:
        print("\nprompt rows: XLA's products (rel. err: against the twin without activation quantization)")
        print_table(prompt_rows, [("shape", "shape", ""), ("projection", "projection", ""), ("out x in", "dims", ""),
                                  ("M", "M", ""), ("weights", "format", ""), ("product", "product", ""),
                                  ("us", "us", ".1f"), ("TFLOP/s", "tflops", ".0f"), ("x bf16", "speedup", ".2f"),
                                  ("rel. err", "err", "")])
    if fp8_rows:
        F.print_summary(fp8_rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "quantized_gemv.json").write_text(json.dumps(dict(ceiling=ceiling, gemv=gemv_rows,
                                                                     batched=batched_rows, prompt=prompt_rows,
                                                                     winners_8bit=table_rows(batched_winners(
                                                                         batched_rows)),
                                                                     fp8_rows=fp8_rows),
                                                                indent=1, default=str))


if __name__ == "__main__":
    main()
