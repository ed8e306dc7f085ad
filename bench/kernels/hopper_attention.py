"""A fresh prompt's causal attention: the Mosaic GPU flash kernel (pallas/hopper_attention.py) against cuDNN's flash
attention (the engine's op for it today) and XLA's, one prompt from position 0.

    PYTHONPATH=. python3 bench/kernels/hopper_attention.py [--tokens 1024 2048 8192] [--out DIR]
    (CPU dry run: --interpret: small heads, XLA in cuDNN's place, each call timed once)

Qwen3-4B's heads (32 query, 8 KV, hd 128; Llama-3-8B's are the same). Each op runs `--calls` times in a row inside
one jit (the output is the next call's query), timed as us a call; FLOPs = 4 x sum over rows of the keys each row
sees (t + 1) x hd x H (no credit for masked work), as TFLOP/s and the share of the dense bf16 GEMM rate measured in
the same run. Each output is checked against the float32 reference (relative Frobenius error) before it counts.
JSON to DIR/kernels_hopper_attention.json after each prompt length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

from bench.ceilings import dense_gemm_rate
from bench.kernels.kernel_timing import best_ms_per_call, log, rel_err
from bench.kernels.hopper_gemm import TIMING, dry_run_timing
from jaxinfer.ops import reference
from jaxinfer.pallas import hopper_attention
from jaxinfer.pallas.hopper_attention import FlashConfig

CONFIGS = [FlashConfig(64, 2), FlashConfig(64, 1), FlashConfig(64, 1, q_buffers=2), FlashConfig(64, 1, pingpong=False),
           FlashConfig(64, 2, persistent=False)]
RIGHT = 1e-2     # bf16 output and P rounded to bf16: ~3e-3 for a right kernel; a masking error is ~1


def label(cfg: FlashConfig) -> str:
    """"mosaic block_q/stages", then /grid (one CTA an item), /2q (two Q buffers) or /no-pp (no ping-pong)."""
    return (f"mosaic {cfg.block_q}/{cfg.stages}" + ("" if cfg.persistent else "/grid")
            + ("/2q" if cfg.q_buffers == 2 else "") + ("" if cfg.pingpong else "/no-pp"))


def chained(op, calls: int):
    def f(q, k, v):
        return jax.lax.fori_loop(0, calls, lambda _, q: op(q, k, v), q)
    return jax.jit(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 8192])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--configs", type=int, default=len(CONFIGS), help="time the first N of CONFIGS only")
    args = ap.parse_args()
    ip = args.interpret
    H, KVH, hd = (4, 2, 64) if ip else (32, 8, 128)
    if ip:
        dry_run_timing()
    calls = 1 if ip else args.calls
    rate = 1e12 if ip else dense_gemm_rate()
    log(f"# dense bf16 GEMM rate {rate / 1e12:.0f} TFLOP/s; {jax.devices()[0].device_kind}")
    scale = hd ** -0.5
    results, table = [], []

    def save() -> None:
        if args.out:
            with open(os.path.join(args.out, "kernels_hopper_attention.json"), "w") as f:
                json.dump(dict(date=time.strftime("%Y-%m-%d"), rate=rate, heads=[H, KVH, hd], results=results), f,
                          indent=1)

    for T in args.tokens:
        ks = jax.random.split(jax.random.PRNGKey(T), 3)
        q = jax.random.normal(ks[0], (T, H, hd), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(ks[1], (T, KVH, hd), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (T, KVH, hd), jnp.float32).astype(jnp.bfloat16)
        ref = reference.fresh_prompt_attention(*(a.astype(jnp.float32) for a in (q, k, v)), scale)
        flops = 4 * (T * (T + 1) // 2) * hd * H
        ops = {"cudnn": lambda q, k, v: reference.fresh_prompt_attention(q, k, v, scale,
                                                                         implementation="xla" if ip else "cudnn"),
               "xla": lambda q, k, v: reference.fresh_prompt_attention(q, k, v, scale)}
        for cfg in CONFIGS[:args.configs]:
            ops[label(cfg)] = (
                lambda q, k, v, cfg=cfg: hopper_attention.fresh_prompt_flash(q, k, v, scale, config=cfg,
                                                                             interpret=ip))
        row = {}
        for name, op in ops.items():
            try:
                err = rel_err(jax.jit(op)(q, k, v), ref)
                _, ms = best_ms_per_call(chained(op, calls), (q, k, v), calls, **TIMING)
            except Exception as e:  # noqa: BLE001
                log(f"  T={T} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            tflops = flops / (ms / 1e3) / 1e12
            log(f"  T={T} {name}: {1e3 * ms:.1f} us, {tflops:.0f} TFLOP/s ({100 * tflops * 1e12 / rate:.0f}% of the "
                f"GEMM rate), rel err {err:.1e}")
            results.append(dict(T=T, op=name, us=1e3 * ms, tflops=tflops, share=tflops * 1e12 / rate, rel_err=err,
                                **({"config": dataclasses.asdict(cfg)} if name.startswith("mosaic") else {})))
            row[name] = (1e3 * ms, tflops, err)
        table.append((T, row))
        save()

    names = list(ops)
    print(f"\nfresh-prompt attention, heads {H}/{KVH}/{hd}, bf16, causal; us a call (TFLOP/s), dense rate "
          f"{rate / 1e12:.0f} TFLOP/s ({time.strftime('%Y-%m-%d')}); * = rel err over {RIGHT}")
    print("| tokens | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for T, row in table:
        cells = [f"{row[n][0]:.1f} ({row[n][1]:.0f}){'*' if row[n][2] > RIGHT else ''}" if n in row else "-"
                 for n in names]
        print(f"| {T} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
