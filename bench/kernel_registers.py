"""Registers, spills and shared memory of our Pallas kernels for an H200, on a machine without a GPU.

    PYTHONPATH=. python3 bench/kernel_registers.py [--shape qwen3-4b] [--batch 1] [--context 1024]
                                                   [--workloads qkv gate-up ...] [--block-in N] [--rows N]

Each workload of ncu_kernels.ONE_KERNEL is lowered for the `cuda` platform with the H200's description stubbed in
(as tests/test_triton_lowering.py does); each Pallas kernel's Triton module is compiled by the `triton` package
(3.6, as the GPU machine has) for sm_90 and its PTX assembled by the ptxas that package bundles (`ptxas -v`).
Prints per kernel: warps, stages, grid, registers, spills, shared memory, the blocks an SM can hold by registers
(`occupancy`) and the waves that make on 132 SMs; with --sass also its main loop's SASS (cuobjdump's, the longest
backward branch's body): instructions a warp an iteration and the most frequent opcodes, what a kernel bound by its
instructions spends them on (2026-12-04: the int8 decode attention's V tile loaded a byte an LDS.U8; every Pallas
GEMM's product added to its accumulator by FADDs after waiting for its wgmma).
--int8-convert C: the attention workloads on an int8 cache with conversion C; --weights int8|fp8: the GEMV, skinny
and grouped workloads on 8-bit weights (the GEMVs' configs as the engine's ops pick them); int8-w8a8|fp8-w8a8: the
skinny workloads in W8A8 (x's rows in 8 bits too).
XLA compiles the same module with its own Triton: calibrated against Nsight Compute on the H200 (o_proj 96 here against 98 there). A tool for comparing variants before spending device
time on them. Needs `pip install triton==3.6.0` (not a test dependency: ~190 MB).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile

SMS, REGS_PER_SM, MAX_BLOCKS = 132, 65536, 32


def triton_modules(fn, args) -> list[tuple[dict, str]]:
    """(launch attributes, Triton module text) of each Pallas kernel in fn(*args), lowered for an H200."""
    import jax
    from jax._src.pallas.triton import gpu_info
    from jax._src.pallas.triton import pallas_call_registration as registration

    modules = {}
    lower_module = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = lower_module(*a, **k)
        text = result.module.operation.get_asm(enable_debug_info=False)
        modules[re.search(r"module @(\S+)", text).group(1)] = text
        return result

    stub = gpu_info.get_gpu_info
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower_module
        gpu_info.get_gpu_info = stub
    out = []
    for call in re.finditer(r"custom_call @__gpu\$xla\.gpu\.triton.*", text):
        attrs = {k: int(v) for k, v in re.findall(r"(grid_[xyz]|num_warps|num_stages) = (\d+)", call.group(0))}
        name = re.search(r'name = "([^"]+)"', call.group(0)).group(1)
        out.append(({"name": name, **attrs}, modules[name]))
    return out


def sass_loops(sass: str) -> list[dict]:
    """Each loop of a kernel's SASS (cuobjdump -sass): the body of every backward branch, its length and its dozen
    most frequent opcodes (predicates and modifiers dropped)."""
    import collections

    instrs = [(int(m.group(1), 16), m.group(2).strip())
              for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    where = {a: i for i, (a, _) in enumerate(instrs)}
    loops = []
    for i, (address, ins) in enumerate(instrs):
        m = re.search(r"BRA (?:`\()?(0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < address and int(m.group(1), 16) in where:
            body = [x for _, x in instrs[where[int(m.group(1), 16)]:i + 1]]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
            loops.append(dict(length=len(body), ops=dict(ops.most_common(12))))
    return loops


def assemble(module: str, num_warps: int, num_stages: int, sass: bool = False) -> dict:
    """Compile a Triton module for sm_90 with the triton package; ptxas -v's registers, spills and shared memory;
    sass: also the main loop (sass_loops' longest) of the cubin's SASS."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.ttir")
        with open(path, "w") as f:
            f.write(module)
        kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        with open(path + ".ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        log = subprocess.run([os.path.join(tools, "ptxas"), "-v", "--gpu-name", "sm_90a", path + ".ptx", "-o",
                              path + ".cubin"], capture_output=True, text=True, check=True).stderr
        loops = sass_loops(subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path + ".cubin"],
                                          capture_output=True, text=True, check=True).stdout) if sass else []
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0   # noqa: E731
    main_loop = max(loops, key=lambda l: l["length"], default=None)
    return dict(regs=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                smem=kernel.metadata.shared, loop=main_loop)


def occupancy(regs: int, num_warps: int, programs: int) -> tuple[int, float]:
    """Blocks an SM by registers and the waves of `programs` on the H200. A warp's registers are allocated in units
    of 8 a thread, from one of the SM's four 16K-register partitions: this reproduces every limit ncu reported
    (66 registers -> 28 one-warp blocks, 98 -> 16, 92 with 4 warps -> 5, 48 with 4 -> 10)."""
    per_warp = math.ceil(regs / 8) * 8 * 32
    warps = 4 * (REGS_PER_SM // 4 // per_warp)
    blocks = min(MAX_BLOCKS, warps // num_warps)
    return blocks, programs / (SMS * blocks) if blocks else float("inf")


def main() -> None:
    from bench.ncu_kernels import ONE_KERNEL, kernel_call

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--workloads", nargs="+", default=["qkv", "gate-up", "o-proj", "down", "attention-rope"],
                    choices=list(ONE_KERNEL))
    ap.add_argument("--block-in", type=int, default=None)
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--int8-convert", default=None, choices=["cvt", "bits", "prmt"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", "int8", "fp8", "int8-w8a8", "fp8-w8a8"],
                    help="the GEMV, skinny and grouped workloads' weights (8-bit: a scale an output channel; -w8a8: "
                         "the skinny workloads' x in that format too)")
    ap.add_argument("--sass", action="store_true", help="also each kernel's main loop (cuobjdump -sass)")
    args = ap.parse_args()
    print(f"{args.shape}, batch {args.batch}, context {args.context}"
          + (f", block_in {args.block_in}" if args.block_in else "") + (f", rows {args.rows}" if args.rows else "")
          + (f", {args.weights} weights" if args.weights != "bf16" else "")
          + (f", int8 cache ({args.int8_convert})" if args.int8_convert else ""))
    loop_cols = " main loop SASS a warp | its opcodes |" if args.sass else ""
    print("| workload | kernel | warps | stages | grid | regs | spill bytes | smem bytes | blocks/SM by regs | waves |"
          + loop_cols)
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.sass else ""))
    for w in args.workloads:
        fn, fn_args = kernel_call(w, args.shape, args.batch, args.context, args.block_in, args.rows,
                                  int8_convert=args.int8_convert, weights=args.weights)
        for attrs, module in triton_modules(fn, fn_args):
            r = assemble(module, attrs["num_warps"], attrs["num_stages"], sass=args.sass)
            programs = attrs["grid_x"] * attrs["grid_y"] * attrs["grid_z"]
            blocks, waves = occupancy(r["regs"], attrs["num_warps"], programs)
            loop = r["loop"] or dict(length="-", ops={})
            loop_row = (f" {loop['length']} | {' '.join(f'{k} {v}' for k, v in loop['ops'].items())} |"
                        if args.sass else "")
            print(f"| {w} | {attrs['name']} | {attrs['num_warps']} | {attrs['num_stages']} | {programs:,} | "
                  f"{r['regs']} | {r['spill_stores']} | {r['smem']:,} | {blocks} | {waves:.2f} |" + loop_row,
                  flush=True)


if __name__ == "__main__":
    main()
