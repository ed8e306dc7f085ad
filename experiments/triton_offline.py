"""Compile a Pallas Triton kernel for the H200 (sm_90) on a machine without a GPU, to read what it becomes.

Pallas lowers a kernel to Triton IR (TTIR) on any machine (the GPU's description stubbed in, as
tests/test_triton_lowering.py does); the pip `triton` wheel (its own ptxas included) compiles that TTIR to TTGIR
(layouts, shared memory, the software pipeline), LLVM IR, PTX and a cubin without a GPU. This prints, per kernel,
what decides its speed before any timing: registers a thread and spills (ptxas), shared memory, the MMA flavour
(mma.sync / wgmma, and of what types), layout conversions through shared memory, async copies (cp.async / TMA),
and the instruction mix of the PTX (conversions, loads, FMAs).

Two environments: this project's (jax 0.11.2) writes the TTIR files; a separate venv with the pip wheel
`triton==3.6.0` (the GPU machine's version) compiles them:

    PYENV_VERSION=3.12.1 python3.12 -m venv /tmp/tritonenv && /tmp/tritonenv/bin/pip install triton==3.6.0
    .venv/bin/python experiments/triton_offline.py decode-attention --out /tmp/ttir
    /tmp/tritonenv/bin/python experiments/triton_offline.py compile /tmp/ttir

XLA compiles the same TTIR with its own Triton build on the GPU, which may differ in passes from the wheel's: read
these as what Triton 3.6 makes of the kernel, to be checked against ncu on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path


def capture(fn, *args, out: Path, tag: str, extra: dict | None = None) -> list[Path]:
    """Lower jit(fn)(*args) for CUDA (an H200 stubbed in) and write each Pallas Triton kernel's TTIR with its
    num_warps / num_stages beside it (tag-NN.ttir, tag-NN.json)."""
    import jax
    from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration as reg

    modules = []
    real_lower = lowering.lower_jaxpr_to_triton_module
    real_info = gpu_info.get_gpu_info

    def lower(*a, **k):
        result = real_lower(*a, **k)
        modules.append(result.module.operation.get_asm())
        return result

    reg.lowering.lower_jaxpr_to_triton_module = lower
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = real_lower
        gpu_info.get_gpu_info = real_info
    configs = [dict(name=m.group(1), num_stages=int(m.group(2)), num_warps=int(m.group(3)))
               for m in re.finditer(r'name = "([^"]+)".*?num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, asm in enumerate(modules):
        p = out / f"{tag}-{i:02d}.ttir"
        p.write_text(asm)
        (out / f"{tag}-{i:02d}.json").write_text(json.dumps({**(configs[i] if i < len(configs) else {}),
                                                              **(extra or {})}))
        paths.append(p)
    return paths


def decode_attention(out: Path, context: int, batch: int, kv: list[str], configs: list[str], converts: list[str]
                     ) -> None:
    """The split decode attention kernel at Qwen3-4B's heads (32 / 8, head_dim 128) over `context` positions of
    `batch` sequences: for each page dtype in kv (bf16, int8), the table's config or each of `configs`
    ("splits/block_k/warps/stages"), and for int8 each conversion in `converts`."""
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.pallas import decode_attention as DA
    from jaxinfer.pallas.decode_attention_rope import decode_attention_rope_write

    H, KVH, hd, page = 32, 8, 128, 16
    pages = batch * context // page
    q = jnp.zeros((batch, H, hd), jnp.bfloat16)
    pt = jnp.asarray(np.arange(pages, dtype=np.int32).reshape(batch, -1))
    cl = jnp.full((batch,), context, jnp.int32)
    for name in kv:
        dtype = jnp.int8 if name == "int8" else jnp.bfloat16
        cache = jnp.zeros((1, KVH, pages * page, hd), dtype)
        scales = dict(k_scale=jnp.ones((1, KVH, pages * page), jnp.float32),
                      v_scale=jnp.ones((1, KVH, pages * page), jnp.float32)) if name == "int8" else {}
        table = DA.choose_config(batch, KVH, context, jnp.dtype(dtype).itemsize, name == "int8", hd)
        chosen = [table] if not configs else [DA.SplitConfig(*map(int, c.split("/"))) for c in configs]
        for cfg in chosen:
            for how in (converts if name == "int8" else ["-"]):
                conv = dict(int8_convert=how) if name == "int8" else {}
                fn = lambda q, k, v, pt, cl, s=scales, cfg=cfg, conv=conv: DA.paged_decode_attention(
                    q, k, v, 0, pt, cl, page, 0.088, config=cfg, **conv, **s)
                tag = (f"decode-attention-{name}{'-' + how if name == 'int8' else ''}-b{batch}-{context}-"
                       f"s{cfg.num_splits}k{cfg.block_k}w{cfg.num_warps}st{cfg.num_stages}")
                for p in capture(fn, q, cache, cache, pt, cl, out=out, tag=tag,
                                 extra=dict(positions_per_iteration=cfg.block_k)):
                    print(p)
                # the fused kernel of a decode step (norm, RoPE and the new token's cache write, then the same
                # split attention)
                qkv, cs, qn = (jnp.zeros((batch, (H + 2 * KVH) * hd), jnp.bfloat16),
                               jnp.zeros((batch, hd), jnp.bfloat16), jnp.zeros((1, hd), jnp.bfloat16))
                fused = lambda qkv, cs, qn, k, v, pt, cl, s=scales, cfg=cfg, conv=conv: decode_attention_rope_write(
                    qkv, cs, cs, qn, qn, k, v, 0, cl - 1, pt, cl, page_size=page, scale=0.088, num_heads=H,
                    num_kv_heads=KVH, config=cfg, **conv, **s)
                for p in capture(fused, qkv, cs, qn, cache, cache, pt, cl, out=out, tag=tag.replace(
                        "decode-attention", "fused-attention"), extra=dict(positions_per_iteration=cfg.block_k)):
                    print(p)


# ---- the compiling side (the triton wheel's environment) ----

PTX_COUNTS = {   # instruction families worth counting in a kernel's PTX
    "wgmma": r"\bwgmma\.mma_async", "mma.sync": r"\bmma\.sync", "ldmatrix": r"\bldmatrix", "cp.async": r"\bcp\.async\.",
    "tma": r"cp\.async\.bulk\.tensor", "ld.global": r"\bld\.global", "ld.shared": r"\bld\.shared",
    "st.shared": r"\bst\.shared", "cvt": r"\bcvt\.", "prmt": r"\bprmt", "fma": r"\bfma\.", "bar.sync": r"\bbar\.sync",
    "shfl": r"\bshfl\.",
}


def sass_loops(sass: str) -> list[dict]:
    """Each backward branch's loop in a cubin's SASS: its length and its most frequent opcodes."""
    import collections

    instrs = [(int(m.group(1), 16), m.group(2).strip())
              for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    where = {a: i for i, (a, _) in enumerate(instrs)}
    loops = []
    for i, (a, ins) in enumerate(instrs):
        m = re.search(r"BRA (0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < a:
            body = [x for _, x in instrs[where[int(m.group(1), 16)]:i + 1]]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
            loops.append(dict(length=len(body), ops=dict(ops.most_common(12))))
    return loops


def compile_dir(folder: Path) -> None:
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    target = GPUTarget("cuda", 90, 32)
    rows = []
    for ttir in sorted(folder.glob("*.ttir")):
        cfg = json.loads(ttir.with_suffix(".json").read_text() or "{}")
        opts = {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
        try:
            kernel = triton.compile(str(ttir), target=target, options=opts)
        except Exception as e:   # noqa: BLE001 (a kernel the wheel cannot take: say so, go on)
            rows.append(dict(kernel=ttir.stem, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        asm = kernel.asm
        ttgir, ptx = asm.get("ttgir", ""), asm.get("ptx", "")
        (folder / f"{ttir.stem}.ttgir").write_text(ttgir)
        (folder / f"{ttir.stem}.ptx").write_text(ptx)
        cubin = folder / f"{ttir.stem}.cubin"
        info = subprocess.run([str(bin_dir / "ptxas"), "-v", "--gpu-name", "sm_90a", str(folder / f"{ttir.stem}.ptx"),
                               "-o", str(cubin)], capture_output=True, text=True).stderr
        sass = subprocess.run([str(bin_dir / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
        (folder / f"{ttir.stem}.sass").write_text(sass)
        regs = re.search(r"Used (\d+) registers", info)
        spills = re.search(r"(\d+) bytes spill stores", info)
        loops = sass_loops(sass)
        main_loop = max(loops, key=lambda l: l["length"]) if loops else None
        per = cfg.get("positions_per_iteration")
        row = dict(kernel=ttir.stem, **opts, regs=int(regs.group(1)) if regs else None,
                   spill_bytes=int(spills.group(1)) if spills else None, shared=kernel.metadata.shared,
                   convert_layout=len(re.findall(r"ttg\.convert_layout", ttgir)),
                   mma=sorted(set(re.findall(r"#ttg\.nvidia_mma<\{versionMajor = (\d)", ttgir))),
                   loop_sass=main_loop["length"] if main_loop else None,
                   sass_per_position=round(main_loop["length"] / per, 2) if main_loop and per else None,
                   loop_ops=main_loop["ops"] if main_loop else None,
                   **{k: len(re.findall(v, ptx)) for k, v in PTX_COUNTS.items()})
        rows.append(row)
    for r in rows:
        print(json.dumps(r))
    (folder / "summary.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decode-attention")
    d.add_argument("--out", type=Path, default=Path("/tmp/ttir"))
    d.add_argument("--context", type=int, default=32768)
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--kv", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    d.add_argument("--configs", nargs="*", default=[], help="splits/block_k/warps/stages (default: the table's)")
    d.add_argument("--converts", nargs="+", default=["prmt"], choices=["prmt", "prmt-staged", "cvt", "bits"])
    c = sub.add_parser("compile")
    c.add_argument("folder", type=Path)
    args = ap.parse_args()
    if args.what == "compile":
        compile_dir(args.folder)
    else:
        decode_attention(args.out, args.context, args.batch, args.kv, args.configs, args.converts)


if __name__ == "__main__":
    main()
