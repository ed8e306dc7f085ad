"""Does jaxlib 0.11.2's XLA launch a Mosaic GPU kernel programmatically (PDL) when the kernel uses
griddepcontrol (Mosaic GPU marks such a module `uses_pdl`)? A chain of tiny dependent kernels in one jit, each
y = x + 1 on a [128, 128] f32 tile, with and without the griddepcontrol calls; the time a kernel per variant.

    PYTHONPATH=. python3 bench/pdl_mosaic_probe.py [--n 200]     (run it with and without
        XLA_FLAGS=--xla_gpu_enable_pdl=true: gpu_round.sh `pdlmosaic`)

If the launches overlap, the griddepcontrol variant's time a kernel falls below the plain one's under the flag
(and not without it), and every variant's output is x + n.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

SHAPE = (128, 128)


def step(x: jax.Array, pdl: bool, interpret: bool = False) -> jax.Array:
    def body(x_gmem, y_gmem, smem, bar):
        if pdl:
            plgpu.griddepcontrol_launch_dependents()
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
        plgpu.barrier_wait(bar)
        smem[...] = smem[...] + 1.0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, y_gmem)
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32), grid=(1,), grid_names=("x",),
                        scratch_types=[plgpu.SMEM(SHAPE, jnp.float32), plgpu.Barrier(num_arrivals=1)],
                        kernel_name="pdl_probe" if pdl else "plain_probe",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    if interpret:
        with plgpu.force_gpu_interpret_mode():
            return call(x)
    return call(x)


def chain(x, n: int, pdl: bool, interpret: bool = False):
    for _ in range(n):
        x = step(x, pdl, interpret)
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()
    n = 3 if args.interpret else args.n
    x = jnp.zeros(SHAPE, jnp.float32)
    print(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, {n} kernels a call")
    for pdl in (False,) if args.interpret else (False, True, False, True):   # no griddepcontrol in interpret mode
        f = jax.jit(functools.partial(chain, n=n, pdl=pdl, interpret=args.interpret))
        y = f(x)
        ok = bool(np.all(np.asarray(y) == n))
        best = float("inf")
        for _ in range(5 if not args.interpret else 1):
            t0 = time.perf_counter()
            for _ in range(20 if not args.interpret else 1):
                y = f(x)
            jax.block_until_ready(y)
            best = min(best, (time.perf_counter() - t0) / (20 if not args.interpret else 1))
        print(f"| griddepcontrol {pdl} | {1e6 * best / n:.2f} us a kernel | output x + n: {ok} |", flush=True)


if __name__ == "__main__":
    main()
