"""Does jaxlib 0.11.2's XLA launch a Mosaic GPU kernel programmatically (PDL) when the kernel uses griddepcontrol
(Mosaic GPU marks such a module `mosaic_gpu.uses_pdl`, which the CUDA plugin reads), and what would it buy the
decode GEMVs? Two chains of dependent kernels in one jit each, with and without the griddepcontrol calls:

- "tiny": one CTA a kernel, y = x + 1 on a [16, 128] float32 tile through shared memory (the launch alone);
- "stream": kernels that stream weight matrices of the batch-1 Qwen3-4B layer's sizes (QKV, o_proj, gate/up, down:
  one CTA an SM, each its rows by TMA through a shared-memory ring, as a GEMV would read them) and pass the
  dependent value on as "tiny" does. With griddepcontrol the kernel's first `--prefetch` weight tiles are in
  flight before it waits for the kernel before it (and it lets the next one launch at its start): what a Mosaic
  GEMV could overlap. The time a layer against its bytes at the HBM read ceiling measured in the same run.

    PYTHONPATH=. python3 bench/pdl_mosaic_probe.py [--mode tiny stream] [--n 200] [--layers 8] [--prefetch 4]
    (run it without and with XLA_FLAGS=--xla_gpu_enable_pdl=true: gpu_round.sh `pdlmosaic`)

If the launches overlap, the griddepcontrol variants are faster under the flag (and not without it); every
variant's output is x + (kernels in the chain).
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from bench.kernel_timing import best_ms_per_call
from jaxinfer.pallas.blocks import run_mosaic

SHAPE = (16, 128)     # the dependent value: 8 KB of float32
TK = 64             # weight tile columns: 64 bf16 = one 128-byte swizzled row
# Qwen3-4B's batch-1 layer as one CTA an SM (132) streaming (rows, K) each: ~the projections' bytes
LAYER = {"qkv": (48, 2560), "o_proj": (24, 4096), "gate_up": (144, 2560), "down": (24, 9728)}
CTAS = 132
SMEM_RING = 192 * 1024   # bytes of shared memory the ring may take (227 KB a CTA on the H200)


def _params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _pass_on(x_gmem, y_gmem, smem, bar):
    """y = x + 1 through shared memory (the kernel's dependent work)."""
    plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
    plgpu.barrier_wait(bar)
    smem[...] = smem[...] + 1.0
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, y_gmem)
    plgpu.wait_smem_to_gmem(0)


def step(x: jax.Array, pdl: bool, interpret: bool = False) -> jax.Array:
    """One tiny kernel: y = x + 1."""
    def body(x_gmem, y_gmem, smem, bar):
        if pdl:
            plgpu.griddepcontrol_launch_dependents()
            plgpu.griddepcontrol_wait()
        _pass_on(x_gmem, y_gmem, smem, bar)

    call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32), grid=(1,), grid_names=("x",),
                        scratch_types=[plgpu.SMEM(SHAPE, jnp.float32), plgpu.Barrier(num_arrivals=1)],
                        kernel_name="pdl_probe" if pdl else "plain_probe", compiler_params=_params())
    return run_mosaic(call, x, interpret=interpret)


def stream_step(x: jax.Array, w: jax.Array, pdl: bool, prefetch: int, stages: int = 8,
                interpret: bool = False) -> jax.Array:
    """One streaming kernel: CTA c reads w[c] ([rows, K]) in [rows, TK] tiles through a `stages`-deep ring; CTA 0
    also computes y = x + 1. With pdl, the wait for the kernel before comes at tile `prefetch` (the ring has the
    next tiles in flight by then) and CTA 0's read of x after it."""
    ctas, rows, K = w.shape
    steps = K // TK
    stages = max(1, min(stages, SMEM_RING // (rows * TK * w.dtype.itemsize)))   # the ring within shared memory
    at = min(prefetch, steps - 1)
    swizzle = 128
    transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    def body(x_gmem, w_gmem, y_gmem, smem, bar):
        c = jax.lax.axis_index("x")
        if pdl:
            plgpu.griddepcontrol_launch_dependents()

        def tile(idx, w_smem):
            @pl.when(idx[0] == at)
            def _():
                if pdl:
                    plgpu.griddepcontrol_wait()

                @pl.when(c == 0)
                def _():
                    _pass_on(x_gmem, y_gmem, smem, bar)

        spec = plgpu.BlockSpec((rows, TK), lambda k: (0, k), transforms=transforms)
        plgpu.emit_pipeline(tile, grid=(steps,), in_specs=[spec], max_concurrent_steps=stages)(w_gmem.at[c])

    call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32), grid=(ctas,), grid_names=("x",),
                        scratch_types=[plgpu.SMEM(SHAPE, jnp.float32), plgpu.Barrier(num_arrivals=1)],
                        kernel_name="pdl_stream" if pdl else "plain_stream", compiler_params=_params())
    return run_mosaic(call, x, w, interpret=interpret)


def chain(x, n: int, pdl: bool, interpret: bool = False):
    for _ in range(n):
        x = step(x, pdl, interpret)
    return x


def stream_chain(x, weights, pdl: bool, prefetch: int, stages: int = 8, interpret: bool = False):
    """Each layer's matrices in turn (weights: [(qkv, o_proj, gate_up, down)] per layer)."""
    for layer in weights:
        for w in layer:
            x = stream_step(x, w, pdl, prefetch, stages, interpret=interpret)
    return x


def make_weights(layers: int, ctas: int = CTAS, layer_shapes=LAYER, seed: int = 0):
    key = jax.random.PRNGKey(seed)
    out = []
    for i in range(layers):
        ks = jax.random.split(jax.random.fold_in(key, i), len(layer_shapes))
        out.append([jax.random.normal(k, (ctas, rows, K), jnp.bfloat16) for k, (rows, K) in
                    zip(ks, layer_shapes.values())])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", nargs="+", default=["tiny", "stream"], choices=["tiny", "stream"])
    ap.add_argument("--n", type=int, default=200, help="tiny kernels a chain")
    ap.add_argument("--layers", type=int, default=8, help="stream: layers of 4 matrices (distinct weights)")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16],
                    help="ring depths of the plain stream (the griddepcontrol ones run at 8)")
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (no griddepcontrol: interpret mode lacks it)")
    args = ap.parse_args()
    x = jnp.zeros(SHAPE, jnp.float32)
    print(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    pdls = (False,) if args.interpret else (False, True)
    target_s = None if args.interpret else 0.3   # timed runs long enough for the GPU's clocks (kernel_timing)
    if "tiny" in args.mode:
        n = 3 if args.interpret else args.n
        for pdl in pdls * (1 if args.interpret else 2):
            f = jax.jit(functools.partial(chain, n=n, pdl=pdl, interpret=args.interpret))
            y, ms = best_ms_per_call(f, (x,), calls=n, target_s=target_s)
            ok = bool(np.all(np.asarray(y) == n))
            print(f"| tiny | griddepcontrol {pdl} | {1e3 * ms:.2f} us a kernel | output right: {ok} |", flush=True)
    if "stream" in args.mode:
        if args.interpret:
            shapes, layers, ctas = {"a": (8, 2 * TK), "b": (16, 3 * TK)}, 1, 2
        else:
            shapes, layers, ctas = LAYER, args.layers, CTAS
        weights = make_weights(layers, ctas, shapes)
        layer_bytes = sum(w.size * w.dtype.itemsize for w in weights[0])
        ceiling = None
        if not args.interpret:
            from bench.ceilings import hbm_read_ceiling

            ceiling = hbm_read_ceiling()
            print(f"# HBM read ceiling {ceiling / 1e12:.2f} TB/s; a layer {layer_bytes / 1e6:.1f} MB "
                  f"({1e6 * layer_bytes / ceiling:.1f} us at the ceiling)", flush=True)
        kernels = layers * len(shapes)
        runs = [(False, 0, st) for st in ([8] if args.interpret else args.stages)]
        runs += [(True, p, 8) for p in args.prefetch] if True in pdls else []
        for pdl, prefetch, stages in runs:
            # the weights are arguments (never constants of the executable)
            f = jax.jit(functools.partial(stream_chain, pdl=pdl, prefetch=prefetch, stages=stages,
                                          interpret=args.interpret))
            y, ms = best_ms_per_call(lambda x: f(x, weights=weights), (x,), calls=layers, target_s=target_s)
            ok = bool(np.all(np.asarray(y) == kernels))
            t = ms / 1e3
            share = f"{100 * layer_bytes / ceiling / t:.1f}%" if ceiling else "-"
            print(f"| stream | griddepcontrol {pdl}, prefetch {prefetch}, stages {stages} | {1e6 * t:.2f} us a layer | "
                  f"{share} of the ceiling | output right: {ok} |", flush=True)


if __name__ == "__main__":
    main()
