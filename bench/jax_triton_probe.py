"""Can official Triton (the device's triton 3.6, called through jax_triton) stream a decode GEMV from a persistent
kernel faster than Pallas Triton does? (twenty-eighth session; issue 3's persistent-layer question)

    PYTHONPATH=.:/tmp/site python3 bench/jax_triton_probe.py      (jax_triton's wheel installed to /tmp/site)

Pallas Triton's persistent loop (pallas/persistent_gemv.py) streams at ~64-69% of the read ceiling where the chain of
fused_gemv kernels reaches ~80%: Pallas gives no control over Triton's software pipeliner for loads that feed no dot,
so a persistent program's bytes in flight are what its registers hold. Official Triton exposes `tl.range(...,
num_stages=S)` on any loop. This probe (1) checks that jax_triton runs on jax 0.11.2 (a vector add against jnp), (2)
times one GEMV over a gate/up-shaped stack (8 x 19,456 rows x 2,560, ~797 MB) as a persistent kernel: P programs, each
an equal contiguous share of R-row tiles, the tile loop pipelined S deep, against fused_gemv (the engine's kernel) on
the same matrix and the HBM read ceiling of the same run. Prints a table; the JSON goes to $OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore")


def main() -> None:
    out_dir = os.environ.get("OUT", ".")
    try:
        import triton.backends.nvidia.driver as nv_driver

        # jax_triton 0.4.1 imports TMA_TF32 from triton's NVIDIA driver, which triton 3.6.0 does not have; without
        # it jax_triton takes the NVIDIA backend for absent and every call fails ("'_Stub' object has no attribute
        # 'backend'", call 4). It is used only for TMA descriptors of float32 rounded to tf32 (none here).
        if not hasattr(nv_driver, "TMA_TF32"):
            nv_driver.TMA_TF32 = -1
        import jax_triton as jt
        import triton
    except Exception as e:   # noqa: BLE001 (the probe's first question)
        print(f"jax_triton import failed: {type(e).__name__}: {e}")
        sys.exit(1)
    from bench.official_triton_kernels import add_kernel, stream_gemv

    print(f"# jax {jax.__version__}, triton {triton.__version__}, jax_triton {getattr(jt, '__version__', '?')}",
          flush=True)

    x = jnp.arange(1000, dtype=jnp.float32)
    y = jnp.ones(1000, jnp.float32)
    try:
        o = jax.jit(lambda x, y: jt.triton_call(x, y, kernel=add_kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                grid=(8,), n=1000, block=128))(x, y)
        ok = bool(jnp.all(o == x + 1))
    except Exception as e:   # noqa: BLE001
        print(f"triton_call failed: {type(e).__name__}: {str(e)[:2000]}")
        sys.exit(1)
    print(f"# vector add through jax_triton: {'right' if ok else 'WRONG'}", flush=True)

    from bench.ceilings import hbm_read_ceiling
    from bench.kernel_timing import best_ms_per_call
    from jaxinfer.pallas.fused_gemv import fused_gemv

    ceiling = hbm_read_ceiling()
    N, K = 8 * 19456, 2560
    w = (jax.random.normal(jax.random.PRNGKey(0), (N, K), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    xv = jax.random.normal(jax.random.PRNGKey(1), (K,), jnp.float32).astype(jnp.bfloat16)
    ref = jnp.dot(w.astype(jnp.float32), xv.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    nbytes = w.size * 2
    print(f"# HBM read ceiling {ceiling / 1e12:.2f} TB/s; matrix {nbytes / 1e6:.0f} MB "
          f"({1e6 * nbytes / ceiling:.1f} us at the ceiling)")
    print("| kernel | us | share of the read ceiling | rel err |")
    print("|---|---|---|---|")
    rows = []

    def report(name, f, *args):
        try:
            t0 = time.perf_counter()
            y, ms = best_ms_per_call(f, args, calls=1, target_s=0.3)
        except Exception as e:   # noqa: BLE001 (a config that does not compile is a row)
            print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} | | |", flush=True)
            rows.append(dict(kernel=name, error=str(e)[:400]))
            return
        y = jnp.ravel(y).astype(jnp.float32)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        us = 1e3 * ms
        share = nbytes / ceiling / (us * 1e-6)
        rows.append(dict(kernel=name, us=us, share=share, rel_err=err, wall_s=time.perf_counter() - t0))
        print(f"| {name} | {us:.1f} | {100 * share:.1f}% | {err:.1e} |", flush=True)

    report("fused_gemv (Pallas, the engine's: block_in 512, one row a program)",
           jax.jit(lambda x, w: fused_gemv(x[None], w, 0, block_in=512)), xv, w[None])
    for P, R, BK, S, warps in [(132, 4, 512, 1, 4), (132, 4, 512, 3, 4), (132, 4, 512, 4, 4), (132, 8, 512, 3, 8),
                               (132, 8, 512, 4, 8), (132, 16, 256, 3, 8), (264, 4, 512, 3, 4), (264, 2, 512, 4, 4),
                               (264, 4, 256, 4, 4), (528, 2, 512, 3, 4), (132, 8, 256, 6, 8), (132, 2, 512, 8, 2)]:
        f = jax.jit(lambda w, x, P=P, R=R, BK=BK, S=S, warps=warps: jt.triton_call(
            w, x, kernel=stream_gemv, out_type=jax.ShapeDtypeStruct((N,), jnp.bfloat16), grid=(P,), num_warps=warps,
            num_stages=S, N=N, K=K, R=R, BK=BK, P=P, S=S))
        report(f"official Triton persistent: P {P}, R {R}, BK {BK}, stages {S}, warps {warps}", f, w, xv)
    chain_rows = chain_probe(jt, ceiling)
    with open(os.path.join(out_dir, "jax_triton_probe.json"), "w") as fh:
        json.dump(dict(ceiling=ceiling, bytes=nbytes, rows=rows, chain=chain_rows), fh, indent=1)


def chain_probe(jt, ceiling: float) -> list[dict]:
    """Part 3: kernels_persistent_gemv's chain (a layer's four products, 8 Qwen3-4B-shaped layers) as one official
    Triton kernel: each phase a pipelined tile loop (tl.range num_stages), a grid barrier between phases (release
    add, volatile polls, acquire add; a poll limit so that a launch that is not all resident says so instead of
    hanging), against the fused_gemv chain."""
    from bench.kernel_timing import best_ms_per_call
    from bench.kernels_persistent_gemv import fused_gemv_chain, make_weights
    from bench.official_triton_kernels import chain_kernel
    from jaxinfer.pallas.persistent_gemv import reference_chain

    D, Q, I, L = 2560, 6144, 9728, 8
    ws = make_weights(D, Q, I, L)
    layer_bytes = sum(w[0].size * 2 for w in ws)
    x = jax.random.normal(jax.random.PRNGKey(1), (D,), jnp.float32).astype(jnp.bfloat16)
    print(f"\n## official Triton persistent chain, Qwen3-4B shape: {L} layers of {layer_bytes / 1e6:.1f} MB "
          f"({1e6 * layer_bytes / ceiling:.2f} us a layer at the ceiling)")
    print("| variant | us a layer | share of the read ceiling | rel err after 2 layers vs twin | timed out CTAs |")
    print("|---|---|---|---|---|")
    ref = np.asarray(reference_chain(x, tuple(w[:2] for w in ws)), np.float32)
    rows = []

    def rel(y):
        y = np.asarray(y, np.float32)
        return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30)) if np.all(np.isfinite(y)) else float("nan")

    def share(us):
        return layer_bytes / ceiling / (us * 1e-6)

    base = jax.jit(fused_gemv_chain)
    _, ms = best_ms_per_call(base, (x, ws), calls=L, target_s=0.3)
    us = 1e3 * ms
    print(f"| fused_gemv chain (Pallas, 4 kernels a layer) | {us:.2f} | {100 * share(us):.1f}% "
          f"| {rel(base(x, tuple(w[:2] for w in ws))):.1e} | 0 |", flush=True)
    rows.append(dict(variant="fused_gemv chain", us=us))
    for P, warps, R, BK, S, barriers in [(132, 4, (4, 2, 2, 1), 512, 3, False), (132, 4, (4, 2, 2, 1), 512, 3, True),
                                         (132, 8, (8, 4, 4, 2), 512, 3, True), (132, 4, (4, 2, 2, 1), 256, 4, True),
                                         (264, 4, (2, 1, 1, 1), 512, 3, True), (132, 4, (4, 2, 2, 1), 512, 2, True)]:
        name = f"P {P}, warps {warps}, rows {R}, BK {BK}, stages {S}" + ("" if barriers else ", no barriers")
        def build(Lx, P=P, warps=warps, R=R, BK=BK, S=S, barriers=barriers):
            out_type = (jax.ShapeDtypeStruct((Lx, D), jnp.bfloat16), jax.ShapeDtypeStruct((Lx, Q), jnp.bfloat16),
                        jax.ShapeDtypeStruct((Lx, D), jnp.bfloat16), jax.ShapeDtypeStruct((Lx, I), jnp.bfloat16),
                        jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((P,), jnp.int32))
            return jax.jit(lambda x, ws: jt.triton_call(
                x, *ws, kernel=chain_kernel, out_type=out_type, grid=(P,), num_warps=warps, num_stages=S,
                zeroed_outputs=(4,), L=Lx, D=D, Q=Q, I=I, R0=R[0], R1=R[1], R2=R[2], R3=R[3], BK=BK, P=P, S=S,
                BARRIERS=barriers, MAXP=1 << 16))

        f = build(L)
        try:
            outs, ms = best_ms_per_call(f, (x, ws), calls=L, target_s=0.3)
        except Exception as e:   # noqa: BLE001
            print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} | | | |", flush=True)
            rows.append(dict(variant=name, error=str(e)[:600]))
            continue
        us = 1e3 * ms
        two = build(2)(x, tuple(w[:2] for w in ws))   # compared after two layers (no norms: the stream grows)
        timed_out = int(np.count_nonzero(np.asarray(outs[5]))) + int(np.count_nonzero(np.asarray(two[5])))
        err = rel(two[0][1])
        rows.append(dict(variant=name, us=us, share=share(us), rel_err=err, timed_out=timed_out))
        print(f"| {name} | {us:.2f} | {100 * share(us):.1f}% | {err:.1e} | {timed_out} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
