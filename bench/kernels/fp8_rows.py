"""fp8 per-channel weights at batched-decode and prompt rows: every way ops.pallas can run the product, against bf16
as it routes it today, and the table rows that pick among them (bench/kernels/quantized_gemv.py --fp8-rows).

For each projection of a layer (QKV, o_proj + residual, gate/up + SwiGLU, down + residual) and each row count M:
- bf16: ops.pallas's op as the engine calls it (the skinny kernel where tables.SKINNY_GEMM has the shape, the Hopper
  GEMM where tables.HOPPER_GEMM does, else XLA's GEMM);
- skinny: the skinny kernel's 8-bit variant (M <= skinny_gemm.MAX_T) at choose_config, and with sweep its configs
  (bench/kernels/skinny_gemm.py's phase A) for a share of the budget each (shape, M): what fills SKINNY_GEMM_8BIT;
- w8a8: ops.pallas.w8a8_product (each row of x to e4m3, XLA's dot on fp8 operands: cuBLASLt's fp8 GEMM on Hopper),
  float32 sums; w8a8-bf16dot: the same dot writing bf16 (half the output bytes, rounded once more);
- converted: reference.quantized_product (the values converted to bf16 in the GEMM's fusion, scales after): what
  XLA's product is below FP8_W8A8_ROWS.
Epilogues (rounding, residual, SwiGLU) in XLA after the XLA products, fused by it. Decode rows run every layer's own
matrix a call (each call reads HBM), prompt rows 4 layers' (compute bound). Each 8-bit output is checked against
twins.linear_8bit: 2e-2 relative, W8A8 6e-2 (the e4m3 rounding of x).
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp

from bench.kernels.kernel_timing import best_ms_per_call, log, rel_err
from jaxinfer.ops import pallas as P
from jaxinfer.ops import reference, twins
from jaxinfer.pallas import skinny_gemm as SG

f32, bf16 = jnp.float32, jnp.bfloat16
TOL = {"skinny": 2e-2, "converted": 2e-2, "w8a8": 6e-2, "w8a8-bf16dot": 6e-2}
MARGIN = 0.97   # a table row is kept where its product beat the alternative by 3%


def epilogue_of(epilogue: str):
    """f(y float32, res) -> the projection's output as the reference ops round it (bf16)."""
    def finish(y, res):
        y = y.astype(bf16)
        return reference.swiglu(y) if epilogue == "swiglu" else res + y if epilogue == "residual" else y
    return finish


def routed(epilogue: str, interpret: bool):
    """The bf16 op as ops.pallas routes it (o_proj/down: linear_residual; gate/up: SwiGLU of normed rows)."""
    def fn(x, w, res):
        if epilogue == "residual":
            return P.linear_residual(x, w, None, res, interpret=interpret)
        if epilogue == "swiglu":
            return P._swiglu_of_normed(x, w, interpret=interpret)
        return P.linear(x, w, interpret=interpret)
    return fn


def skinny(cfg, epilogue: str, interpret: bool):
    def fn(x, w, res):
        kw = dict(residual=res) if epilogue == "residual" else {}
        return SG.skinny_gemm(x, w.values[None], 0, w_scale=w.scale[None], config=cfg, epilogue=epilogue,
                              interpret=interpret, **kw)
    return fn


def xla(product, epilogue: str):
    finish = epilogue_of(epilogue)
    return lambda x, w, res: finish(product(x, w), res)


def time_fp8_rows(shape: str, cfg: dict, Ms: list[int], sweep: bool, layers: int, budget_s: float, ceiling: float,
                  interpret: bool, random_8bit, projections, sweep_configs, out: list) -> None:
    """Appends a row per (projection, M, product, config) to out (and logs it). layers: matrices a decode-rows call
    runs over (prompt rows: 4; 2 in interpret mode)."""
    projs = [p for p in projections(cfg) if p[3] != "logits"]
    group_s = budget_s / max(1, len(projs) * sum(M <= SG.MAX_T for M in Ms))
    for name, n, k, epilogue, _ in projs:
        keys = jax.random.split(jax.random.PRNGKey(n + k), 4)
        for M in Ms:
            L = layers if M <= SG.MAX_T else (2 if interpret else 4)
            bf_ws = [(0.02 * jax.random.normal(kk, (n, k), f32)).astype(bf16) for kk in jax.random.split(keys[0], L)]
            ws = [random_8bit(kk, n, k, "fp8") for kk in jax.random.split(keys[0], L)]
            x = jax.random.normal(keys[1], (M, k), bf16)
            res = jax.random.normal(keys[2], (M, n), bf16)
            ref = twins.linear_8bit(x, ws[0], residual=res, epilogue=epilogue)
            cands = [("bf16", "routed", "", routed(epilogue, interpret), bf_ws)]
            if M <= SG.MAX_T:
                cfgs = [SG.choose_config(M, n, k, epilogue)]
                cfgs += [c for c in sweep_configs(k) if sweep and c not in cfgs]
                cands += [("fp8", "skinny", c, skinny(c, epilogue, interpret), ws) for c in cfgs]
            cands += [("fp8", "w8a8", "", xla(P.w8a8_product, epilogue), ws),
                      ("fp8", "w8a8-bf16dot", "", xla(lambda x, w: P.w8a8_product(x, w, bf16), epilogue), ws),
                      ("fp8", "converted", "", xla(reference.quantized_product, epilogue), ws)]
            deadline = time.time() + group_s
            base = None
            for fmt, product, config, fn, wl in cands:
                if product == "skinny" and config != cands[1][2] and time.time() > deadline:
                    continue   # the sweep's share of the budget is spent: the XLA products still run
                try:
                    f = jax.jit(lambda x, wl, res, fn=fn: [fn(x, w, res) for w in wl])
                    outs, ms = best_ms_per_call(f, (x, wl, res), L, 3, target_s=0.15)
                except Exception as e:   # a config that does not compile is reported, not fatal
                    log(f"# {shape} {name} M={M} {product} {config}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                us = 1e3 * ms
                base = us if fmt == "bf16" else base
                err = "" if fmt == "bf16" else f"{rel_err(outs[0], ref):.1e}"
                nb = sum(a.nbytes for a in jax.tree.leaves(wl[0]))
                row = dict(shape=shape, projection=name, dims=f"{n}x{k}", n=n, k=k, epilogue=epilogue, M=M,
                           weights=fmt, product=product,
                           config=dataclasses.astuple(config) if config else "", us=us,
                           tflops=2 * M * n * k / (us * 1e-6) / 1e12, share=nb / (us * 1e-6) / ceiling,
                           speedup=(base or us) / us, err=err + ("" if fmt == "bf16" or float(err) <= TOL[product]
                                                                 else " FAIL"))
                out.append(row)
                log(json.dumps(row))
            del bf_ws, ws


def _best(rows: list[dict], product: str) -> dict | None:
    ok = [r for r in rows if r["product"] == product and "FAIL" not in r["err"]]
    return min(ok, key=lambda r: r["us"]) if ok else None


def best_by_rows(rows: list[dict]) -> list[dict]:
    """Per (shape, projection, M): each product's best time and the fastest fp8 one against bf16."""
    out = []
    for key in dict.fromkeys((r["shape"], r["projection"], r["M"]) for r in rows):
        group = [r for r in rows if (r["shape"], r["projection"], r["M"]) == key]
        bests = {p: _best(group, p) for p in ("routed", "skinny", "w8a8", "w8a8-bf16dot", "converted")}
        fp8 = [b for p, b in bests.items() if b and p != "routed"]
        if not bests["routed"] or not fp8:
            continue
        win = min(fp8, key=lambda r: r["us"])
        fmt = lambda p: f"{bests[p]['us']:.1f}" if bests[p] else "-"
        out.append(dict(shape=key[0], projection=key[1], dims=group[0]["dims"], epilogue=group[0]["epilogue"],
                        n=group[0]["n"], k=group[0]["k"], M=key[2], bf16=fmt("routed"), skinny=fmt("skinny"),
                        skinny_config=str(bests["skinny"]["config"]) if bests["skinny"] else "", w8a8=fmt("w8a8"),
                        w8a8_bf16dot=fmt("w8a8-bf16dot"), converted=fmt("converted"), best=win["product"],
                        best_us=win["us"], speedup=bests["routed"]["us"] / win["us"],
                        skinny_us=bests["skinny"]["us"] if bests["skinny"] else None,
                        skinny_cfg=bests["skinny"]["config"] if bests["skinny"] else None,
                        w8a8_us=bests["w8a8"]["us"] if bests["w8a8"] else None,
                        converted_us=bests["converted"]["us"] if bests["converted"] else None))
    return out


def table_entries(best: list[dict]) -> tuple[list[tuple], int | None]:
    """([(SKINNY_GEMM_8BIT key, config tuple, kernel us, XLA us)], FP8_W8A8_ROWS): a skinny row where its best config
    beat XLA's faster product (W8A8 or the converted values) by MARGIN; the threshold: the fewest measured rows from
    which W8A8 beat the converted values at every shape and every larger row count the skinny table does not take
    (None: nowhere)."""
    entries, xla_points = [], []
    for b in best:
        xla_us = min(u for u in (b["w8a8_us"], b["converted_us"]) if u is not None)
        if b["skinny_us"] is not None and b["M"] in (16, 32, 64) and b["skinny_us"] < MARGIN * xla_us:
            entries.append(((b["n"], b["k"], b["epilogue"], b["M"]), tuple(b["skinny_cfg"]), b["skinny_us"], xla_us))
        elif b["w8a8_us"] is not None and b["converted_us"] is not None:
            xla_points.append((b["M"], b["w8a8_us"] < b["converted_us"]))
    rows = None
    for M in sorted({m for m, _ in xla_points}, reverse=True):
        if all(win for m, win in xla_points if m >= M):
            rows = M
        else:
            break
    return entries, rows


def apply_tables(path: str) -> str:
    """Patch tables.SKINNY_GEMM_8BIT and FP8_W8A8_ROWS with what a --fp8-rows run measured (its quantized_gemv.json):
    the A/B of the tables in the whole step before they are pasted. Returns what it set."""
    from jaxinfer.pallas import tables

    entries, rows = table_entries(best_by_rows(json.loads(open(path).read())["fp8_rows"]))
    for key, cfg, _, _ in entries:
        tables.SKINNY_GEMM_8BIT[key] = SG.SkinnyConfig(*cfg)
    tables.FP8_W8A8_ROWS = rows
    return f"SKINNY_GEMM_8BIT + {len(entries)} rows {[e[0] for e in entries]}, FP8_W8A8_ROWS = {rows}"


def print_summary(rows: list[dict]) -> None:
    from bench.table import print_table

    best = best_by_rows(rows)
    print("\nfp8 per-channel weights by rows: us per call of each product (best config), the fastest against bf16 "
          "as routed today")
    print_table(best, [("shape", "shape", ""), ("projection", "projection", ""), ("out x in", "dims", ""),
                       ("M", "M", ""), ("bf16 us", "bf16", ""), ("skinny 8-bit us", "skinny", ""),
                       ("its config", "skinny_config", ""), ("W8A8 us", "w8a8", ""),
                       ("W8A8 bf16-dot us", "w8a8_bf16dot", ""), ("converted us", "converted", ""),
                       ("best fp8", "best", ""), ("x bf16", "speedup", ".2f")])
    entries, threshold = table_entries(best)
    print("\ntables.SKINNY_GEMM_8BIT rows (the skinny kernel beat XLA's products by 3%):")
    print("\n".join(f"    {key}: SkinnyConfig{cfg},   # {us:.2f} us vs XLA {xla_us:.2f}"
                    for key, cfg, us, xla_us in entries) or "    (none)")
    print(f"tables.FP8_W8A8_ROWS = {threshold}")
