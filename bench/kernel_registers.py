"""Registers, spills and shared memory of our Pallas kernels for an H200, on a machine without a GPU.

    PYTHONPATH=. python3 bench/kernel_registers.py [--shape qwen3-4b] [--batch 1] [--context 1024]
                                                   [--workloads qkv gate-up ...] [--block-in N] [--rows N]

Each workload of ncu_kernels.ONE_KERNEL is lowered for the `cuda` platform with the H200's description stubbed in
(as tests/test_triton_lowering.py does); each Pallas kernel's Triton module is compiled by the `triton` package
(3.6, as the GPU machine has) for sm_90 and its PTX assembled by the ptxas that package bundles (`ptxas -v`).
Prints per kernel: warps, stages, grid, registers, spills, shared memory, the blocks an SM can hold by registers
(`occupancy`) and the waves that make on 132 SMs.
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


def assemble(module: str, num_warps: int, num_stages: int) -> dict:
    """Compile a Triton module for sm_90 with the triton package; ptxas -v's registers, spills and shared memory."""
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
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path + ".ptx", "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0   # noqa: E731
    return dict(regs=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                smem=kernel.metadata.shared)


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
    args = ap.parse_args()
    print(f"{args.shape}, batch {args.batch}, context {args.context}"
          + (f", block_in {args.block_in}" if args.block_in else "") + (f", rows {args.rows}" if args.rows else ""))
    print("| workload | kernel | warps | stages | grid | regs | spill bytes | smem bytes | blocks/SM by regs | waves |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in args.workloads:
        fn, fn_args = kernel_call(w, args.shape, args.batch, args.context, args.block_in, args.rows)
        for attrs, module in triton_modules(fn, fn_args):
            r = assemble(module, attrs["num_warps"], attrs["num_stages"])
            programs = attrs["grid_x"] * attrs["grid_y"] * attrs["grid_z"]
            blocks, waves = occupancy(r["regs"], attrs["num_warps"], programs)
            print(f"| {w} | {attrs['name']} | {attrs['num_warps']} | {attrs['num_stages']} | {programs:,} | "
                  f"{r['regs']} | {r['spill_stores']} | {r['smem']:,} | {blocks} | {waves:.2f} |", flush=True)


if __name__ == "__main__":
    main()
