"""Does a grid barrier order memory between Pallas Triton programs on this GPU? Counts what it gets wrong.

    PYTHONPATH=. python3 bench/kernels/barrier.py [--programs 128 256 512 1024] [--calls 200]

The persistent MLP block (pallas/mlp_block.py, removed in round 17 after it measured slower than
the two kernels; it is at dae4e19) gave outputs off by 1e-2 at 256 and 512 programs and exact at
1,024 (round 16): its barrier (bar.sync, an acq_rel atomic add at GPU scope, a spin on volatile loads,
an acquire atomic, volatile loads of the data) let some programs read another's stores before they were visible,
or the count went wrong. Anything that orders work across programs (a persistent kernel per layer, a merge done by
the last split to finish) needs an ordering that holds. Here each of P one-warp programs writes W int32 values that
depend on the call, meets the others, then reads two other programs' rows and counts the values it did not
expect; the kernel runs `calls` times, threading its counter. Variants:
  spin          mlp_block's barrier as it is;
  spin+fence    the same with `fence.acq_rel.gpu` (inline PTX) after the stores and after the spin;
  last          no spin: the program whose atomic add completes a multiple of P reads every row (what a merge by
                the last split needs), the others leave;
  last+fence    the same with the fences.
(round 17, H200: no wrong value and the exact counter in every variant at 128-1,024 programs.)
Prints, per variant and program count, the wrong values over all calls and the counter against calls x P (an
atomic done by every thread of a program, not once, would show there). JSON to $OUT. A program count the GPU
cannot keep resident spins forever under `spin`: run it under `timeout`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

i32 = jnp.int32
VARIANTS = ("spin", "spin+fence", "last", "last+fence")


def _fence(x, interpret: bool):
    """`fence.acq_rel.gpu` on this thread; returns x (a scalar int32) through the asm. Pallas marks inline asm
    pure, so the caller must make later work depend on the result in a way the compiler cannot fold (the asm's
    output minus its input is 0 only to us), and feed it a value that is only known after what must precede it."""
    if interpret:
        return x
    v = jnp.broadcast_to(x, (32,))   # a vector: one fence in every lane (and Triton's scalars are not tensors)
    (y,) = plgpu.elementwise_inline_asm("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", args=[v], constraints="=r,r",
                                        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, v.dtype)])
    return jnp.max(y)


def _value(p, i, call):
    return p * 131 + i * 7 + call * 1_000_003


def _kernel(call_ref, cnt_in_ref, data_ref, cnt_ref, bad_ref, *, P, W, variant, interpret):
    del cnt_in_ref   # aliased to cnt_ref
    p = pl.program_id(0)
    call = call_ref[0]
    cols = jnp.arange(W, dtype=i32)
    plgpu.store(data_ref.at[p, cols], _value(p, cols, call))
    fenced = variant.endswith("+fence")
    load_kw = {} if interpret else {"volatile": True}
    if not interpret:
        plgpu.debug_barrier()   # the program's stores before its atomic (bar.sync)
    one = i32(1)
    if fenced:   # a value read after the barrier, through the fence, into the atomic's operand
        c = plgpu.load(cnt_ref.at[i32(0)], **load_kw)
        one = _fence(c, interpret) - c + 1
    old = plgpu.atomic_add(cnt_ref, (i32(0),), one)
    target = (old | (P - 1)) + 1

    def count_bad(q):
        got = plgpu.load(data_ref.at[q, cols], **load_kw)
        return jnp.sum((got != _value(q, cols, call)).astype(i32))

    if variant.startswith("spin"):
        seen = jax.lax.while_loop(lambda c: c - target < 0,
                                  lambda _: plgpu.load(cnt_ref.at[i32(0)], **load_kw), old + 1)
        seen = plgpu.atomic_add(cnt_ref, (i32(0),), i32(0)) + seen - seen   # acquire
        shift = _fence(seen, interpret) - seen if fenced else seen - seen
        if not interpret:
            plgpu.debug_barrier()
        bad = count_bad((p + 1 + shift) % P) + count_bad((p + P // 2 + shift) % P)
        plgpu.store(bad_ref.at[p], bad)
    else:   # the last to arrive reads every row; the others leave
        last = old + 1 == target

        @pl.when(last)
        def _():
            acquire = plgpu.atomic_add(cnt_ref, (i32(0),), i32(0))
            shift = _fence(acquire, interpret) - acquire if fenced else acquire - acquire
            plgpu.store(bad_ref.at[p], jax.lax.fori_loop(0, P, lambda q, acc: acc + count_bad(q + shift), i32(0)))

        @pl.when(jnp.logical_not(last))
        def _():
            plgpu.store(bad_ref.at[p], i32(0))


@functools.partial(jax.jit, static_argnames=("P", "W", "variant", "interpret"), donate_argnames=("counter",))
def check(call, counter, *, P: int, W: int, variant: str, interpret: bool = False):
    """One call: (data [P, W], counter, wrong values per program [P])."""
    kernel = functools.partial(_kernel, P=P, W=W, variant=variant, interpret=interpret)
    data, counter, bad = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((P, W), i32), jax.ShapeDtypeStruct((1,), i32),
                   jax.ShapeDtypeStruct((P,), i32)),
        grid=(P,),
        input_output_aliases={1: 1},
        interpret=interpret,
        name="kernels_barrier",
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
    )(jnp.asarray(call, i32).reshape(1), counter)
    return data, counter, bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, nargs="*", default=[128, 256, 512, 1024])
    ap.add_argument("--width", type=int, default=256, help="int32 values each program writes")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (one program: nothing to order)")
    args = ap.parse_args()
    programs = [1] if args.interpret else args.programs
    rows = []
    for variant in args.variants:
        for P in programs:
            if P & (P - 1):
                raise SystemExit(f"--programs: powers of two only ({P})")
            counter = jnp.zeros((1,), i32)
            wrong, t0 = 0, time.perf_counter()
            for call in range(args.calls):
                _, counter, bad = check(call, counter, P=P, W=args.width, variant=variant, interpret=args.interpret)
                wrong += int(jnp.sum(bad))
            n = int(counter[0])
            rows.append(dict(variant=variant, programs=P, calls=args.calls, wrong=wrong, counter=n,
                             counter_expected=args.calls * P, seconds=round(time.perf_counter() - t0, 2)))
            print(f"# {json.dumps(rows[-1])}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "barrier.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| variant | programs | calls | wrong values | counter | expected |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['programs']} | {r['calls']} | {r['wrong']} | {r['counter']} | "
              f"{r['counter_expected']} |")


if __name__ == "__main__":
    main()
