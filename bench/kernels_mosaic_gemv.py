"""The Mosaic GPU decode GEMV (pallas/mosaic_gemv.py) against the engine's Pallas Triton GEMV (fused_gemv), in a chain
of dependent products shaped like Qwen3-4B's batch-1 layer, with and without programmatic dependent launch.

    PYTHONPATH=. python3 bench/kernels_mosaic_gemv.py [--layers 36] [--stages 4 8]
    (run it without and with XLA_FLAGS=--xla_gpu_enable_pdl=true: gpu_round.sh `mosaicgemv`)

A layer is four products, each reading its own weights (36 layers of distinct matrices, ~212 MB a layer): x [2560]
-> QKV-sized [6144] -> an o_proj stand-in [6144 -> 2560] + x (31.5 MB, the real one 21) -> gate/up + SwiGLU [9728]
-> down [2560] + the stream. The Triton chain runs fused_gemv at the engine's block_in and rows (no norm) on one row;
the Mosaic chains keep the activations as 8 rows (row 0 real, the rest zeros: the kernel's B operand) so that no pad
runs between them. Prints us a layer, the share of the HBM read ceiling measured in the same run, and each chain's
output after two layers against the Triton one's (relative error: the same bf16 roundings, float32 sums in another
order).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernel_timing import best_ms_per_call
from jaxinfer.pallas.fused_gemv import block_in_for, fused_gemv, rows_for
from jaxinfer.pallas.mosaic_gemv import mosaic_gemv

# (out rows, in, epilogue) of a layer's products, in order; out rows of the SwiGLU are gate + up; a residual
# product adds the layer's input (after o_proj) or the sum so far (after down), as the model's residual stream does
LAYER = [(6144, 2560, "none"), (2560, 6144, "residual"), (19456, 2560, "swiglu"), (2560, 9728, "residual")]
TINY = [(128, 64, "none"), (64, 128, "residual"), (256, 64, "swiglu"), (64, 128, "residual")]


def make_weights(layers: int, shapes, seed: int = 0):
    """Each layer's matrices as one-layer stacks [1, n, k] (as the engine's split layers: one kernel compile a shape)."""
    key = jax.random.PRNGKey(seed)
    return [[(jax.random.normal(jax.random.fold_in(key, 100 * i + j), (1, n, k), jnp.float32) / np.sqrt(k))
             .astype(jnp.bfloat16) for j, (n, k, _) in enumerate(shapes)] for i in range(layers)]


def _layers(x, weights, shapes, product):
    for layer in weights:
        stream = x
        for w, (n, k, ep) in zip(layer, shapes):
            x = product(x, w, n, k, ep, stream if ep == "residual" else None)
            stream = x if ep == "residual" else stream
    return x


def triton_chain(x, weights, *, shapes, interpret: bool = False):
    def product(x, w, n, k, ep, res):
        out = n // 2 if ep == "swiglu" else n
        return fused_gemv(x, w, 0, residual=res, epilogue=ep, block_in=block_in_for(out, k, w.dtype),
                          rows=rows_for(out, k), interpret=interpret)

    return _layers(x, weights, shapes, product)


def mosaic_chain(x, weights, *, shapes, pdl: bool, stages: int, interpret: bool = False):
    def product(x, w, n, k, ep, res):
        return mosaic_gemv(x, w, 0, residual=res, epilogue=ep, pdl=pdl, stages=stages, interpret=interpret)

    return _layers(x, weights, shapes, product)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--interpret", action="store_true", help="CPU dry run at tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes, layers = (TINY, 1) if args.interpret else (LAYER, args.layers)
    weights = make_weights(layers, shapes)
    layer_bytes = sum(w.size * w.dtype.itemsize for w in weights[0])
    ceiling = None
    if not args.interpret:
        from bench.ceilings import hbm_read_ceiling

        ceiling = hbm_read_ceiling()
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"# XLA_FLAGS={flags!r}; {layers} layers of {layer_bytes / 1e6:.1f} MB"
          + (f"; HBM read ceiling {ceiling / 1e12:.2f} TB/s" if ceiling else ""), flush=True)
    x1 = jax.random.normal(jax.random.PRNGKey(1), (1, shapes[0][1]), jnp.float32).astype(jnp.bfloat16)
    x8 = jnp.zeros((8, x1.shape[1]), x1.dtype).at[0].set(x1[0])
    target_s = None if args.interpret else 0.3   # timed runs long enough for the GPU's clocks (kernel_timing)
    runs = [("triton", functools.partial(triton_chain, shapes=shapes, interpret=args.interpret), x1)]
    for stages in ([4] if args.interpret else args.stages):
        for pdl in (False, True):
            runs.append((f"mosaic stages {stages}" + (" griddepcontrol" if pdl else ""),
                         functools.partial(mosaic_chain, shapes=shapes, pdl=pdl, stages=stages,
                                           interpret=args.interpret), x8))
    rows, want = [], None
    print("| chain | us a layer | share of the read ceiling | rel err against triton |")
    print("|---|---|---|---|")
    for name, fn, x in runs:
        f = jax.jit(fn)   # the weights are arguments (never constants of the executable)
        _, ms = best_ms_per_call(f, (x, weights), calls=layers, target_s=target_s)
        # compared over the first two layers: without norms the stream (SwiGLU's product) overflows bf16 long before
        # 36 layers (the 36-layer outputs were NaN in both chains, twenty-seventh session call 5)
        y = np.asarray(f(x, weights[:2])[:1], np.float32)
        want = y if want is None else want
        err = float(np.linalg.norm(y - want) / max(np.linalg.norm(want), 1e-30))
        t = ms / 1e3
        share = layer_bytes / ceiling / t if ceiling else None
        rows.append(dict(chain=name, us=1e6 * t, share=share, rel_err=err))
        print(f"| {name} | {1e6 * t:.2f} | {'-' if share is None else f'{100 * share:.1f}%'} | {err:.1e} |", flush=True)
    with open(os.path.join(args.out, "kernels_mosaic_gemv.json"), "w") as fh:
        json.dump(dict(xla_flags=flags, layers=layers, layer_bytes=layer_bytes, ceiling=ceiling, rows=rows), fh,
                  indent=1)


if __name__ == "__main__":
    main()
