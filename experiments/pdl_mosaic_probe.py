"""Does jaxlib 0.11.2's XLA launch a Mosaic GPU kernel programmatically (PDL) when the kernel uses griddepcontrol
(Mosaic GPU marks such a module `mosaic_gpu.uses_pdl`, which the CUDA plugin reads), and what would it buy the
decode GEMVs? Two chains of dependent kernels in one jit each, with and without the griddepcontrol calls:

- "tiny": one CTA a kernel, y = x + 1 on a [16, 128] float32 tile through shared memory (the launch alone);
- "stream": kernels that stream weight matrices of the batch-1 Qwen3-4B layer's sizes (QKV, o_proj, gate/up, down:
  one CTA an SM, each its rows by TMA through a shared-memory ring, as a GEMV would read them) and pass the
  dependent value on as "tiny" does. With griddepcontrol the kernel's first `--prefetch` weight tiles are in
  flight before it waits for the kernel before it (and it lets the next one launch at its start): what a Mosaic
  GEMV could overlap. The time a layer against its bytes at the HBM read ceiling measured in the same run.

- "persistent": the same bytes as one flat pipeline a CTA, one kernel a layer or one for all layers, without and
  with a grid-wide meeting (a global semaphore) at each phase start: what fewer kernel boundaries would buy, and
  what a persistent layer's barriers cost (round 27: NOTES / RESULTS).

    PYTHONPATH=. python3 bench/pdl_mosaic_probe.py [--mode tiny stream persistent] [--n 200] [--layers 8]
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

from bench.kernels.kernel_timing import best_ms_per_call
from jaxinfer.pallas.blocks import run_mosaic

SHAPE = (16, 128)     # the dependent value: 8 KB of float32
TK = 64             # weight tile columns: 64 bf16 = one 128-byte swizzled row
# Qwen3-4B's batch-1 layer as one CTA an SM (132) streaming (rows, K) each: ~the projections' bytes
LAYER = {"qkv": (48, 2560), "o_proj": (24, 4096), "gate_up": (144, 2560), "down": (24, 9728)}
CTAS = 132
SMEM_RING = 192 * 1024   # bytes of shared memory the ring may take (227 KB a CTA on the H200)


def _params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _ring(rows: int, dtype, stages: int):
    """The ring's depth within shared memory, and its tiles' 128-byte swizzle."""
    stages = max(1, min(stages, SMEM_RING // (rows * TK * jnp.dtype(dtype).itemsize)))
    return stages, (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


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
    stages, transforms = _ring(rows, w.dtype, stages)
    at = min(prefetch, steps - 1)

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


# The persistent stream: the layer's bytes a CTA as one flat [ROWS_P, K] matrix of [ROWS_P, TK] tiles, the phases
# (QKV, o_proj, gate/up, down) as runs of tiles: 6,144 bf16 a tile, LAYER's products' bytes a CTA in tiles
ROWS_P = 96
PHASE_TILES = tuple(rows * K // (ROWS_P * TK) for rows, K in LAYER.values())   # (20, 16, 60, 38)


def phase_starts(layers: int, phase_tiles=PHASE_TILES) -> list[int]:
    """The tile indices at which a phase after the first begins, over `layers` layers in one kernel."""
    starts, at = [], 0
    for _ in range(layers):
        for n in phase_tiles:
            starts.append(at)
            at += n
    return starts[1:]


def persistent_step(x: jax.Array, w: jax.Array, layers: int, barriers: bool | str, stages: int = 16,
                    phase_tiles=PHASE_TILES, interpret: bool = False) -> jax.Array:
    """One kernel streaming `layers` layers: CTA c reads w[c] ([ROWS_P, K]) through a `stages`-deep ring; CTA 0
    computes y = x + 1 at its first tile. With barriers, every CTA meets the others at each phase start (a global
    semaphore that only counts up: each adds 1 and spins until it reads ctas x the barrier's ordinal), while the
    tiles already in the ring stay in flight. barriers "signal" / "wait": only that half of each (what each costs)."""
    ctas, rows, K = w.shape
    steps = K // TK
    stages, transforms = _ring(rows, w.dtype, stages)
    starts = phase_starts(layers, phase_tiles)

    def body(x_gmem, w_gmem, y_gmem, smem, bar):
        c = jax.lax.axis_index("x")
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if barriers else None

        def tile(idx, w_smem):
            @pl.when(jnp.logical_and(idx[0] == 0, c == 0))
            def _():
                _pass_on(x_gmem, y_gmem, smem, bar)

            if barriers:
                for ordinal, start in enumerate(starts, 1):
                    @pl.when(idx[0] == start)
                    def _(ordinal=ordinal):
                        if barriers in (True, "signal"):
                            plgpu.semaphore_signal(sem, 1, memory_scope="gpu")
                        if barriers in (True, "wait"):   # "wait" alone: already satisfied (the spin's floor)
                            plgpu.semaphore_wait(sem, ctas * ordinal if barriers is True else 0, decrement=False,
                                                 memory_scope="gpu")

        spec = plgpu.BlockSpec((rows, TK), lambda k: (0, k), transforms=transforms)
        plgpu.emit_pipeline(tile, grid=(steps,), in_specs=[spec], max_concurrent_steps=stages)(w_gmem.at[c])

    call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32), grid=(ctas,), grid_names=("x",),
                        scratch_types=[plgpu.SMEM(SHAPE, jnp.float32), plgpu.Barrier(num_arrivals=1)],
                        kernel_name=f"persistent_barriers_{barriers}" if barriers else "persistent_stream",
                        compiler_params=_params())
    return run_mosaic(call, x, w, interpret=interpret)


def persistent_chain(x, weights, layers_a_kernel: int, barriers: bool | str, stages: int = 16,
                     phase_tiles=PHASE_TILES, interpret: bool = False):
    """weights: [ctas, ROWS_P, K] per kernel, each `layers_a_kernel` layers of tiles."""
    for w in weights:
        x = persistent_step(x, w, layers_a_kernel, barriers, stages, phase_tiles, interpret)
    return x


def make_flat_weights(kernels: int, layers_a_kernel: int, ctas: int = CTAS, rows: int = ROWS_P,
                      phase_tiles=PHASE_TILES, seed: int = 1):
    key = jax.random.PRNGKey(seed)
    K = layers_a_kernel * sum(phase_tiles) * TK
    return [jax.random.normal(jax.random.fold_in(key, i), (ctas, rows, K), jnp.bfloat16) for i in range(kernels)]


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
    ap.add_argument("--mode", nargs="+", default=["tiny", "stream"], choices=["tiny", "stream", "persistent"])
    ap.add_argument("--n", type=int, default=200, help="tiny kernels a chain")
    ap.add_argument("--layers", type=int, default=8, help="stream: layers of 4 matrices (distinct weights)")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16],
                    help="ring depths of the plain stream (the griddepcontrol ones run at 8)")
    ap.add_argument("--only-barrier-count", action="store_true",
                    help="persistent: only the barrier-count runs (1, 2, 4 barriers a layer)")
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
    if "persistent" in args.mode:
        # interpret mode has no global semaphores: the CPU runs the barrier-free kernels only
        layers = 2 if args.interpret else args.layers
        rows, ctas, tiles = (8, 2, (1, 2, 1, 1)) if args.interpret else (ROWS_P, CTAS, PHASE_TILES)
        from bench.ceilings import hbm_read_ceiling

        ceiling = None if args.interpret else hbm_read_ceiling()
        for per_kernel in (1, layers):
            weights = make_flat_weights(layers // per_kernel, per_kernel, ctas, rows, tiles)
            layer_bytes = sum(w.size * w.dtype.itemsize for w in weights) / layers
            for barriers, stages in ((False, 16), (True, 16), (True, 8), ("signal", 16), ("wait", 16)):
                if (barriers and args.interpret) or args.only_barrier_count:
                    continue
                f = jax.jit(functools.partial(persistent_chain, layers_a_kernel=per_kernel, barriers=barriers,
                                              stages=stages, phase_tiles=tiles, interpret=args.interpret))
                y, ms = best_ms_per_call(lambda x: f(x, weights=weights), (x,), calls=layers, target_s=target_s)
                ok = bool(np.all(np.asarray(y) == layers // per_kernel))
                t = ms / 1e3
                share = f"{100 * layer_bytes / ceiling / t:.1f}%" if ceiling else "-"
                print(f"| persistent | {per_kernel} layer(s) a kernel, barriers {barriers}, stages {stages} | "
                      f"{1e6 * t:.2f} us a layer | {share} of the ceiling | output right: {ok} |", flush=True)
        if not args.interpret:
            # the barrier's cost against how often it comes: 1, 2 or 4 a layer (the same bytes, 8 layers a kernel)
            for tiles, barriers in (((sum(PHASE_TILES),), True), ((36, 98), True), (PHASE_TILES, True),
                                    (PHASE_TILES, False)):
                f = jax.jit(functools.partial(persistent_chain, layers_a_kernel=layers, barriers=barriers, stages=16,
                                              phase_tiles=tiles))
                y, ms = best_ms_per_call(lambda x: f(x, weights=weights), (x,), calls=layers, target_s=target_s)
                ok = bool(np.all(np.asarray(y) == 1))
                print(f"| persistent | {layers} layers a kernel, {len(tiles) if barriers else 0} barrier(s) a layer {tiles} | "
                      f"{1e3 * ms:.2f} us a layer | {100 * layer_bytes / ceiling / (ms / 1e3):.1f}% of the ceiling | "
                      f"output right: {ok} |", flush=True)
        del weights


if __name__ == "__main__":
    main()
