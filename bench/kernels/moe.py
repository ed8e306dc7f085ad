"""Mixture-of-experts kernels at real shapes against their ceilings and XLA: the batch-1 routed GEMVs
(pallas/moe_gemv.py) and the grouped GEMM's configs (pallas/grouped_gemm.py) for batched decode and prompt rows.

    PYTHONPATH=. python3 bench/kernels/moe.py [--shapes qwen3-30b-a3b mixtral-8x7b] [--tokens 1 8 64 1024]
                                               [--format bf16|int8|fp8] [--interpret] [--out DIR]

Per shape and token count T, random bf16 weights ([2, E, N, K] stacks, layer 1 read in place):
- "op": ops.pallas.moe_mlp against reference.moe_mlp (XLA: top-k, sort, ragged_dot), both jitted alone, the
  relative error between them; at T = 1 the bytes the active experts and the router hold over the time, against
  the HBM read bandwidth measured in the same run.
- T = 1: the block chained over 8 stacked layers in one jit (sweep_routed: one op a jit is dispatch-bound at these
  sizes): the whole op, the router's GEMV, each routed GEMV config of ROUTED (rows a program, block_in, warps) for
  the gate/up and the combine alone, the two with their routes from elsewhere, and a dense GEMV of the gate/up's
  bytes; each against the bytes it must read over the HBM read bandwidth.
- T > 1: each grouped GEMM config of CONFIGS for the gate/up (SwiGLU) and the down product alone on the same
  expert-sorted rows, against XLA's ragged_dot on them (TFLOP/s of the routed rows' work); on Hopper with bf16
  experts also the grouped Mosaic GPU GEMM at each config of MOSAIC (hopper_gemm's row_tile_group, the rows in
  pallas/expert_tiles.py's padded layout; its TFLOP/s count the routed rows, not the padding). Then, bf16 experts,
  the whole op at each block_m's fastest pair of those configs (no split K) forced through tables.GROUPED_GEMM
  against choose_config's pair ("moe_mlp, table"): the rows a table should be built from.
--format int8 / fp8: the experts' stacks 8-bit (quantize(): one scale an expert's row), the kernels reading their
values and scales, the bytes counted at one a weight.
Prints a table as it goes; writes moe.json. --interpret: the CPU smoke run (tiny shape, interpret mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.kernels.kernel_timing import best_ms_per_call, log, rel_err  # noqa: E402
from jaxinfer.ops import LayerWeight, get_ops, reference  # noqa: E402
from jaxinfer.pallas.grouped_gemm import GroupedGemmConfig, choose_config, grouped_gemm, sorted_items  # noqa: E402
from jaxinfer.ops.quantized import QuantizedWeight, quantize  # noqa: E402
from jaxinfer.pallas import expert_tiles as et  # noqa: E402
from jaxinfer.pallas import hopper_gemm  # noqa: E402
from jaxinfer.pallas.moe_gemv import routed_gemv  # noqa: E402
from jaxinfer.pallas.tables import HopperConfig  # noqa: E402

# (experts, active, D, I)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336), "tiny-moe": (8, 2, 64, 32)}
# none spilling registers at either shape (ptxas for sm_90, bench/kernel_registers.py; 128 x 128 x 32 on 4 warps did)
CONFIGS = [GroupedGemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
           for bm, bn, bk, w, s in [(16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (32, 64, 64, 4, 3), (32, 128, 64, 4, 3),
                                    (64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3),
                                    (128, 128, 64, 8, 2)]]
MOSAIC = [HopperConfig(64, n, 64, stages) for n in (64, 128, 256) for stages in (3, 4)]
ROUTED = [(rows, block_in, warps) for rows in (1, 2, 4) for block_in in (256, 512) for warps in (1, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 1024])
    ap.add_argument("--format", default="bf16", choices=["bf16", "int8", "fp8"],
                    help="the experts' weights: bf16, or 8-bit with one scale an expert's row (quantize())")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (interpret mode)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    interpret = args.interpret
    if interpret:
        args.shapes, args.tokens = ["tiny-moe"], [t for t in args.tokens if t <= 16] or [1, 8]
    pallas = get_ops("pallas-interpret" if interpret else "pallas")
    from bench.ceilings import hbm_read_ceiling

    bw = hbm_read_ceiling(0.125 if interpret else 4)
    log(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; HBM read {bw / 1e12:.2f} TB/s")
    rows = []
    print("| shape | T | what | config | ms | vs XLA | GB/s or TFLOP/s | share of HBM read | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        E, k, D, I = SHAPES[shape]
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        bf = jnp.bfloat16
        router = jax.random.normal(keys[0], (2, E, D), bf) * bf(D ** -0.5)
        gate_up = jax.random.normal(keys[1], (2, E, 2 * I, D), bf) * bf(D ** -0.5)
        down = jax.random.normal(keys[2], (2, E, D, I), bf) * bf(I ** -0.5)
        if args.format != "bf16":
            gate_up, down = quantize(gate_up, args.format), quantize(down, args.format)
        wb = 1 if args.format != "bf16" else 2
        for T in args.tokens:
            x = jax.random.normal(jax.random.fold_in(keys[3], T), (T, D), bf)

            def op(ops):
                return jax.jit(lambda x, r, g, d: ops.moe_mlp(x, *(LayerWeight(w, jnp.int32(1)) for w in (r, g, d)),
                                                              k, True))

            ours, ms = _timed(op(pallas), (x, router, gate_up, down), interpret)
            op_ref, op_xla_ms = _timed(op(reference), (x, router, gate_up, down), interpret)
            row = dict(shape=shape, T=T, what="moe_mlp", config="-", ms=ms, xla_ms=op_xla_ms,
                       rel_err=rel_err(ours, op_ref))
            if T == 1:   # the bytes the op must read: the router and the active experts
                row["gb_s"] = (E * D * 2 + k * 3 * D * I * wb) / (ms * 1e-3) / 1e9
                row["share"] = row["gb_s"] * 1e9 / bw
            rows.append(row)
            _print(row)
            if T == 1:
                rows += sweep_routed(shape, x, router, gate_up, down, k, bw, interpret, fmt=args.format)
                continue
            h = reference.rms_norm(x, jnp.ones(D, bf), 1e-6)
            _, experts = reference.route(reference.linear(h, router[1]), k, True)
            order, group_sizes = reference.sort_by_expert(experts, E)
            xs = h[order // k]
            hs = jax.random.normal(keys[3], (T * k, I), bf)
            best = {"gate_up": {}, "down": {}}   # product -> block_m -> (ms, config): the block rows' candidates
            for name, w, a, n_out in (("gate_up", gate_up, xs, 2 * I), ("down", down, hs, D)):
                ep = "swiglu" if name == "gate_up" else "none"
                xla = jax.jit(lambda a, w, gs: reference.grouped_linear(a, w[1], gs))
                ref, xla_ms = _timed(xla, (a, w, group_sizes), interpret)
                if ep == "swiglu":
                    ref = reference.swiglu(ref)
                flops = 2 * T * k * n_out * a.shape[1]
                for cfg in [choose_config(T * k / E, n_out, a.shape[1], ep)] + ([] if interpret else CONFIGS):
                    f = jax.jit(lambda a, w, gs, cfg=cfg, ep=ep: _grouped(
                        a, w, sorted_items(gs, a.shape[0], cfg.block_m), 1, epilogue=ep, config=cfg,
                        interpret=interpret))
                    try:
                        y, ms = _timed(f, (a, w, group_sizes), interpret)
                        row = dict(shape=shape, T=T, what=name, config=_name(cfg), ms=ms, xla_ms=xla_ms,
                                   tflops=flops / (ms * 1e-3) / 1e12, rel_err=rel_err(y, ref))
                        if cfg.split_k == 1 and ms < best[name].get(cfg.block_m, (float("inf"),))[0]:
                            best[name][cfg.block_m] = (ms, cfg)
                    except Exception as e:   # a config that fails to compile is reported, not fatal
                        row = dict(shape=shape, T=T, what=name, config=_name(cfg),
                                   error=f"{type(e).__name__}: {e}"[:200])
                    rows.append(row)
                    _print(row)
                if args.format == "bf16" and not interpret and hopper_gemm.available():
                    rows += sweep_mosaic(shape, name, a, w, experts, order, ep, ref, xla_ms, flops)
            if args.format == "bf16":
                rows += sweep_blocks(shape, T, k, lambda: op(pallas), (x, router, gate_up, down), best, op_ref,
                                     op_xla_ms, interpret)
            (Path(args.out) / "moe.json").write_text(json.dumps(dict(bandwidth=bw, device=jax.devices()[0].device_kind,
                                                                     rows=rows), indent=1))
    (Path(args.out) / "moe.json").write_text(json.dumps(dict(bandwidth=bw, device=jax.devices()[0].device_kind,
                                                             rows=rows), indent=1))


def sweep_mosaic(shape, name, a, w, experts, order, epilogue, ref, xla_ms, flops) -> list[dict]:
    """The grouped Mosaic GPU GEMM at each config of MOSAIC on the rows `a` (in expert-sorted order, assignment
    order[i] at row i) laid out as pallas/expert_tiles.py pads them; its outputs taken back to the sorted order and
    compared with `ref`. Times the kernel alone (the layout's gathers are XLA's, as the Triton rows' sort is)."""
    T = experts.shape[0]
    E = w.shape[1]
    by_assignment = jnp.zeros_like(a).at[order].set(a)   # row a: assignment a's (one row a "token", top_k 1)
    out = []
    for cfg in MOSAIC:
        if not hopper_gemm.supported(hopper_gemm.cta_tile(cfg)[0], w.shape[2], a.shape[1], epilogue, cfg):
            continue
        row = dict(shape=shape, T=T, what=name, config=f"mosaic {_name(cfg)}")
        tiles = et.expert_tiles(*reference.sort_by_expert(experts, E), hopper_gemm.cta_tile(cfg)[0])
        padded = et.gather_rows(by_assignment, tiles, 1)
        stack = w.reshape(-1, *w.shape[2:])
        groups = jnp.where(tiles.tile_expert >= 0, E + tiles.tile_expert, -1)   # layer 1 of the [2, E] stack
        f = jax.jit(lambda x, w, g, cfg=cfg: hopper_gemm.hopper_gemm(x, w, epilogue=epilogue, row_tile_group=g,
                                                                        config=cfg))
        try:
            y, ms = _timed(f, (padded, stack, groups), False)
            y = y[tiles.position][order]
            row.update(ms=ms, xla_ms=xla_ms, tflops=flops / (ms * 1e-3) / 1e12, rel_err=rel_err(y, ref),
                       padded_rows=int(jnp.sum(tiles.tile_expert >= 0)) * hopper_gemm.cta_tile(cfg)[0])
        except Exception as e:   # a config that fails to compile (shared memory) is reported, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        out.append(row)
        _print(row)
    return out


def sweep_blocks(shape, T, k, make_op, args, best, ref, xla_ms, interpret) -> list[dict]:
    """The whole op (routing, the sort, both products, the weighted sum) at each block_m's fastest gate/up and down
    without split K, forced through tables.GROUPED_GEMM (the grouped Mosaic GEMM's table emptied; one jit each): the
    products' rows above time each kernel alone, a split-K config's partial sums as an XLA kernel of their own, where
    a step's XLA may fuse them into what follows (2026-12-06: Qwen3-30B-A3B's batch 64 moved 2% where those rows said
    10-16%). The first row is choose_config's pair through the same path."""
    from jaxinfer.pallas import tables

    E, two_i, D = args[2].shape[1:]
    A = T * k
    pairs = [(None, None)] + [(best["gate_up"][bm][1], best["down"][bm][1])
                              for bm in sorted(set(best["gate_up"]) & set(best["down"]))]
    saved = tables.GROUPED_GEMM, tables.HOPPER_GROUPED_GEMM
    out = []
    try:
        tables.HOPPER_GROUPED_GEMM = {}
        for up, down in pairs:
            tables.GROUPED_GEMM = {} if up is None else {(E, two_i, D, "swiglu"): ((A, A, up),),
                                                         (E, D, two_i // 2, "none"): ((A, A, down),)}
            config = "rule" if up is None else f"block_m {up.block_m}: {_name(up)} + {_name(down)}"
            row = dict(shape=shape, T=T, what="moe_mlp, table", config=config)
            try:
                y, ms = _timed(make_op(), args, interpret)   # a new jit: traced with this table
                row.update(ms=ms, xla_ms=xla_ms, rel_err=rel_err(y, ref))
            except Exception as e:   # a config that fails to compile is reported, not fatal
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            out.append(row)
            _print(row)
    finally:
        tables.GROUPED_GEMM, tables.HOPPER_GROUPED_GEMM = saved
    return out


def _timed(f, args: tuple, interpret: bool):
    """(outputs, ms a call): best of several timed runs, or one where a call takes over half a second (XLA's
    ragged_dot, if it multiplies every row by every expert)."""
    out = jax.block_until_ready(f(*args))   # compiles
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    once = time.perf_counter() - t0
    if interpret or once > 0.5:
        return out, 1e3 * once
    return best_ms_per_call(f, args, 1, target_s=0.1)


def _routed(x, logits, w, layer, **kw):
    """routed_gemv on a bf16 stack, or on a QuantizedWeight's values with its scales."""
    if isinstance(w, QuantizedWeight):
        return routed_gemv(x, logits, w.values, layer, w_scale=w.scale, w_block=w.block, **kw)
    return routed_gemv(x, logits, w, layer, **kw)


def _grouped(a, w, items, layer, **kw):
    """grouped_gemm on a bf16 stack, or on a QuantizedWeight's values with its scales."""
    if isinstance(w, QuantizedWeight):
        return grouped_gemm(a, w.values, items, layer, w_scale=w.scale, w_block=w.block, **kw)
    return grouped_gemm(a, w, items, layer, **kw)


def sweep_routed(shape, x, router, gate_up, down, k, bw, interpret, layers: int = 8, fmt: str = "bf16") -> list[dict]:
    """The batch-1 block per layer, over `layers` stacked layers in one jit (every call reads HBM, as in a step;
    one op a jit is dispatch-bound at these sizes: 38-50 us a call for kernels of 6-22 us in a traced step):
    the whole op; the router's GEMV alone; the gate/up and the combine alone at each config of ROUTED, routing in
    the kernel; the two kernels with their routes from elsewhere (the gate/up's own written routes, XLA's
    reference.route); and a dense GEMV of the gate/up's bytes (fused_gemv, its table's config) as a yardstick."""
    from jaxinfer.pallas.fused_gemv import fused_gemv

    E, D = router.shape[1], x.shape[1]
    I = down.shape[-1]
    L = 1 if interpret else layers
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    bf = x.dtype
    gu = (jax.random.normal(keys[0], (L, E, 2 * I, D), jnp.float32) * D ** -0.5).astype(bf)
    dn = (jax.random.normal(keys[1], (L, E, D, I), jnp.float32) * I ** -0.5).astype(bf)
    rt = (jax.random.normal(keys[2], (L, E, D), jnp.float32) * D ** -0.5).astype(bf)
    logits = (2 * jax.random.normal(keys[3], (L, 1, E), jnp.float32)).astype(bf)   # a route a layer
    scale = jnp.ones((L, D), bf)
    h = jax.random.normal(jax.random.PRNGKey(1), (k, I), bf)
    if fmt != "bf16":   # 8-bit experts, one scale an expert's output row (quantize(): as --quantization does)
        gu, dn = quantize(gu, fmt), quantize(dn, fmt)
    wb = 1 if fmt != "bf16" else 2   # bytes a weight (the scales: one float an 8-bit row, left out)
    gu_bytes, dn_bytes = k * 2 * I * D * wb, k * D * I * wb
    out, base = [], {}

    def add(what, config, f, args, n_bytes):
        try:
            y, ms = best_ms_per_call(jax.jit(f), args, L, target_s=None if interpret else 0.2)
            base.setdefault(what, y)
            row = dict(shape=shape, T=1, what=what, config=config, ms=ms, xla_ms=float("nan"),
                       gb_s=n_bytes / (ms * 1e-3) / 1e9, share=n_bytes / (ms * 1e-3) / bw,
                       rel_err=rel_err(y, base[what]))
        except Exception as e:   # a config that fails to compile is reported, not fatal
            row = dict(shape=shape, T=1, what=what, config=config, error=f"{type(e).__name__}: {e}"[:200])
        out.append(row)
        _print(row)

    pallas = get_ops("pallas-interpret" if interpret else "pallas")
    def layer_op(x, r, g, d, s):
        return [pallas.rms_norm_moe_mlp(x, LayerWeight(s, jnp.int32(i)), 1e-6,
                                        *(LayerWeight(w, jnp.int32(i)) for w in (r, g, d)), k, True) for i in range(L)]
    add(f"op (router + two kernels){'' if fmt == 'bf16' else ', ' + fmt}", "-", layer_op, (x, rt, gu, dn, scale),
        E * D * 2 + gu_bytes + dn_bytes)
    add("router GEMV", "-", lambda x, r, s: [pallas.rms_norm_linear(x, LayerWeight(s, jnp.int32(i)), 1e-6,
                                                                    LayerWeight(r, jnp.int32(i))) for i in range(L)],
        (x, rt, scale), E * D * 2)
    for cfg in ROUTED[:1] if interpret else ROUTED:
        rows_, block_in, warps = cfg
        kw = dict(top_k=k, renormalize=True, rows=rows_, block_in=block_in, num_warps=warps, interpret=interpret)
        name = "/".join(map(str, cfg))
        add("routed gate_up", name, lambda x, lg, g, s, kw=kw: [
            _routed(x, lg[i], g, i, epilogue="swiglu", scale=s, **kw) for i in range(L)], (x, logits, gu, scale),
            gu_bytes)
        add("routed combine", name, lambda h, lg, d, r, kw=kw: [
            _routed(h, lg[i], d, i, epilogue="combine", residual=r, **kw) for i in range(L)], (h, logits, dn, x),
            dn_bytes)
    kw = dict(top_k=k, renormalize=True, interpret=interpret)
    routes = [reference.route(logits[i], k, True) for i in range(L)]
    routes = [(e[0], w[0]) for w, e in routes]
    add("routed gate_up", "default, routes given", lambda x, rs, g, s: [
        _routed(x, None, g, i, epilogue="swiglu", scale=s, routes=rs[i], **kw) for i in range(L)],
        (x, routes, gu, scale), gu_bytes)
    add("routed combine", "default, routes given", lambda h, rs, d, r: [
        _routed(h, None, d, i, epilogue="combine", residual=r, routes=rs[i], **kw) for i in range(L)],
        (h, routes, dn, x), dn_bytes)

    def pair(x, lg, g, d, s, how):
        ys = []
        for i in range(L):
            if how == "own":
                hh = _routed(x, lg[i], g, i, epilogue="swiglu", scale=s, **kw)
                ys.append(_routed(hh, lg[i], d, i, epilogue="combine", residual=x, **kw))
            elif how == "emitted":
                hh, rs = _routed(x, lg[i], g, i, epilogue="swiglu", scale=s, emit_routes=True, **kw)
                ys.append(_routed(hh, None, d, i, epilogue="combine", residual=x, routes=rs, **kw))
            else:
                w, e = reference.route(lg[i], k, True)
                rs = (e[0], w[0])
                hh = _routed(x, None, g, i, epilogue="swiglu", scale=s, routes=rs, **kw)
                ys.append(_routed(hh, None, d, i, epilogue="combine", residual=x, routes=rs, **kw))
        return ys
    for how in ("own", "emitted", "xla"):
        add("both kernels", "routes " + {"own": "in each", "emitted": "from the gate/up", "xla": "from XLA"}[how],
            lambda x, lg, g, d, s, how=how: pair(x, lg, g, d, s, how), (x, logits, gu, dn, scale),
            gu_bytes + dn_bytes)
    if fmt != "bf16":
        return out
    dense = (jax.random.normal(keys[0], (L, k * 2 * I, D), jnp.float32) * D ** -0.5).astype(bf)
    add("dense GEMV of the gate/up's bytes", f"{k * 2 * I}x{D}/256", lambda x, w, s: [
        fused_gemv(x, w, i, scale=s, epilogue="swiglu", interpret=interpret) for i in range(L)], (x, dense, scale),
        gu_bytes)
    return out


def _name(cfg: GroupedGemmConfig) -> str:
    return "/".join(str(v) for v in dataclasses.astuple(cfg))


def _print(r: dict) -> None:
    if "error" in r:
        print(f"| {r['shape']} | {r['T']} | {r['what']} | {r['config']} | failed: {r['error'][:80]} | | | | |",
              flush=True)
        return
    rate = f"{r['gb_s']:.0f} GB/s" if "gb_s" in r else f"{r['tflops']:.1f} TFLOP/s" if "tflops" in r else "-"
    share = f"{100 * r['share']:.1f}%" if "share" in r else "-"
    vs = f"{r['xla_ms'] / r['ms']:.2f}x" if r["xla_ms"] == r["xla_ms"] else "-"   # nan: no XLA twin timed
    print(f"| {r['shape']} | {r['T']} | {r['what']} | {r['config']} | {r['ms']:.3f} | {vs} | {rate} | {share} | "
          f"{r['rel_err']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
