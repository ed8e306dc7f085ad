"""The engine's batch-1 decode projections (pallas/fused_gemv.py) by output rows per program, on the GPU.

    PYTHONPATH=. python3 bench/kernels/fused_gemv.py [--shape qwen3-4b] [--rows 1 2 4 8] [--out DIR]

What fills tables.GEMV_ROWS. A one-row program loads x (and the norm's scale) once per weight tile; several rows
a program share those loads. For each projection of a layer, this times one jit that runs it over every layer of a
stacked [L, out, in] array (L x the bytes: every call reads HBM, as in the step): the engine's kernel (its norm
prologue / epilogue) at 1, 2, 4, 8 rows per program and the same product without the prologue; each output checked
against the one-row kernel's. Prints one table: us per call and the share of the HBM read ceiling measured in the
run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.ceilings import hbm_read_ceiling
from bench.kernels.kernel_timing import best_ms_per_call, log, rel_err
from bench.table import print_table
from jaxinfer.pallas.fused_gemv import block_in_for, fused_gemv
from bench.random_model import SHAPES


def projections(cfg: dict) -> list[tuple[str, int, int, str, bool]]:
    """(name, weight rows, in, epilogue, norm prologue) for each decode projection of a layer."""
    D, I = cfg["hidden_size"], cfg["intermediate_size"]
    H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or D // H
    return [("qkv", (H + 2 * K) * hd, D, "none", True), ("o_proj", D, H * hd, "residual", False),
            ("gate/up", 2 * I, D, "swiglu", True), ("down", D, I, "residual", False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=0, help="layers stacked (0: the model's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (use --shape tiny)")
    args = ap.parse_args()
    ip = args.interpret
    cfg = SHAPES[args.shape]
    L = args.layers or cfg["num_hidden_layers"]
    ceiling = 1e11 if args.interpret else hbm_read_ceiling()
    log(f"# HBM read ceiling {ceiling / 1e12:.2f} TB/s")
    bf = jnp.bfloat16
    rows_out = []
    for name, n, k, epilogue, norm in projections(cfg):
        keys = jax.random.split(jax.random.PRNGKey(n + k), 4)
        w = (jax.random.normal(keys[0], (L, n, k), jnp.float32) * 0.02).astype(bf)
        x = jax.random.normal(keys[1], (1, k), bf)
        scale = (1 + 0.1 * jax.random.normal(keys[2], (L, k), jnp.float32)).astype(bf)
        res = jax.random.normal(keys[3], (1, n), bf)
        block_in = block_in_for(n // 2 if epilogue == "swiglu" else n, k, bf)
        nbytes = n * k * 2
        kw = dict(residual=res) if epilogue == "residual" else {}

        def engine_kernel(rows, prologue=norm):
            def f(x, w, scale):
                return [fused_gemv(x, w, i, scale=scale if prologue else None, epilogue=epilogue, block_in=block_in,
                                   rows=rows, interpret=ip, **kw) for i in range(L)]
            return jax.jit(f)

        variants = [(f"engine, {r} row{'s' if r > 1 else ''}", engine_kernel(r)) for r in args.rows
                    if (n // 2 if epilogue == "swiglu" else n) % r == 0]
        if norm:
            variants.append(("engine without the norm prologue, 1 row", engine_kernel(1, prologue=False)))
        base = None
        for label, f in variants:
            outs, ms = best_ms_per_call(f, (x, w, scale), L, args.repeats, target_s=0.25)
            err = None
            if label.startswith("engine, 1 row"):
                base = outs
            elif base is not None and label.startswith("engine, "):
                err = max(rel_err(o, b) for o, b in zip(outs, base))
            us = 1e3 * ms
            row = dict(projection=name, shape=f"{n}x{k}", variant=label, us=us, share=nbytes / (us * 1e-6) / ceiling,
                       err="" if err is None else f"{err:.1e}")
            rows_out.append(row)
            log(json.dumps(row))
        del w
    print(f"\n{args.shape}, batch 1, bf16, {L} layers stacked; HBM read ceiling {ceiling / 1e12:.2f} TB/s")
    print_table(rows_out, [("projection", "projection", ""), ("shape", "shape", ""), ("variant", "variant", ""),
                           ("us per call", "us", ".2f"), ("share of ceiling", "share", ".1%"),
                           ("rel. err vs 1 row (MLP block: vs two kernels)", "err", "")])
    Path(args.out, "fused_gemv.json").write_text(json.dumps(dict(ceiling=ceiling, rows=rows_out), indent=1))


if __name__ == "__main__":
    main()
