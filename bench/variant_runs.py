"""Run a bench script's variants each in its own process (XLA reads its flags once per process).

The child prints one line `RESULT {json}`; its table rows (`|...`) and profile lines are echoed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def add_variant_args(ap, variants) -> None:
    """The options both dispatch benches take: model shape and ops, which variants, the child flag."""
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--ops", default="pallas")
    ap.add_argument("--variants", nargs="*", default=list(variants))
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per variant")
    ap.add_argument("--child", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))


# XLA flags the dispatch benches' variants combine: every command type in the command buffers (loops and
# conditionals too), and XLA's fusion of a (dynamic) slice into the GEMM that reads it
_COMMAND_TYPES = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
EVERY_COMMAND_TYPE = _COMMAND_TYPES + "DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
# the same without DYNAMIC_SLICE_FUSION
LOOPS_IN_COMMAND_BUFFERS = _COMMAND_TYPES + "WHILE,CONDITIONAL"
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
SLICE_FUSION = "--xla_gpu_enable_dynamic_slice_fusion=true"
# Programmatic dependent launch (Hopper+; in jaxlib 0.11.2's XLA, off by default): XLA puts a grid-dependency
# wait at the start of the kernels it compiles (its fusions and the Triton ones, Pallas's included) and launches
# them so that a kernel's blocks may be scheduled while the kernel before it drains; PDL_LAUNCH also lets each
# kernel signal its dependent early (launch_dependents), so the next one's launch overlaps more of the tail
PDL = "--xla_gpu_enable_pdl=true"
PDL_LAUNCH = PDL + " --xla_gpu_enable_pdl_launch=true"


def run_variants(script: str, variants: dict[str, str], child_args: list[str], timeout: float) -> list[dict]:
    """For each variant name -> XLA_FLAGS, run `script --child NAME *child_args` with those flags
    added; returns one row per variant: its RESULT fields, or `error`, and the jaxinfer package the children
    import (the same PYTHONPATH as here: an A/B against an older package puts that one first)."""
    import jaxinfer

    package = os.path.dirname(os.path.abspath(jaxinfer.__file__))
    print(f"# jaxinfer from {package}", flush=True)
    rows = []
    for name, flags in variants.items():
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}
        cmd = [sys.executable, script, "--child", name, *child_args]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            out = p.stdout + p.stderr
            line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else dict(error=out.strip().splitlines()[-1][:200] if out.strip() else "?")
            print(f"# {name}: {json.dumps(res)}", flush=True)
            print("\n".join(l for l in p.stdout.splitlines() if l.startswith(("|", "# profile", "# idle"))), flush=True)
        except subprocess.TimeoutExpired:
            res = dict(error="timeout")
        rows.append(dict(variant=name, flags=flags, package=package, **res))
    return rows


def apply_bench_options(options: dict) -> dict:
    """Pop the bench-only options from a child's engine options and apply them before the engine loads:
    "gemv_rows" (the decode GEMVs' output rows per program: an int for every shape, or tables.GEMV_ROWS entries),
    "gemv_block_in" ({(out, in): block_in} for the decode GEMVs of those shapes: tables.GEMV_BLOCK_IN entries),
    "attention_config" ((splits, block_k) for every decode attention call, throughput.force_attention_config),
    "no_hopper_gemm" (prompt rows on XLA's GEMM where hopper_gemm's table would take them: its table emptied),
    "hopper_table" (a bench/kernels/hopper_gemm.py JSON: each of hopper_gemm's table rows at the config that ran fastest),
    "flash_table" (tables.FRESH_PROMPT_FLASH's rows: [[first, last, FlashConfig's fields], ...], the Mosaic GPU flash
    attention for a fresh prompt of those lengths; [] gives every length to cuDNN's),
    "rope_write_tiled" (the norm/RoPE/cache-write kernel with a program's tokens as tiles of that many:
    tables.ROPE_KV_WRITE_TILE),
    "unpacked_batch" (the prompt step takes its batch as ~20 arrays, split by a call of its own) and
    "weights": "stacked" (the layers unrolled over the stacked [L, ...] arrays: a dozen arrays a step) or
    "split-every-array" (every per-layer array its own, vectors too). Returns the other options (the layers must be unrolled: unroll_layers),
    with the Tuning switch executable_cache=False where the step's code was patched."""
    options = dict(options)
    import jax

    import jaxinfer.engine.engine
    import jaxinfer.model.weights
    from jaxinfer.pallas import tables

    # These patch the step's code, not a table. The executable cache's key sees the source, the flags, the
    # arguments and the kernels' tables (pallas/tables.py), not a patched function (attention_config, weights,
    # the batch's transfer): such a child compiles afresh. The table patches keep the cache.
    patched = ("attention_config" in options or bool(options.get("unpacked_batch"))
               or options.get("weights") is not None)
    if "gemv_rows" in options:   # the decode GEMVs' output rows per program: every shape's, or {(out, in): rows}
        rows = options.pop("gemv_rows")
        tables.GEMV_ROWS.clear()
        if isinstance(rows, dict):
            tables.GEMV_ROWS.update(rows)
        else:
            tables.GEMV_DEFAULT_ROWS = rows
    if "gemv_block_in" in options:   # {(out, in): block_in}; fused_gemv.block_in_for reads the table
        tables.GEMV_BLOCK_IN.update(options.pop("gemv_block_in"))
    if "attention_config" in options:   # every decode attention call at this (splits, block_k)
        from bench.throughput import force_attention_config

        force_attention_config(*options.pop("attention_config"))
    if options.pop("no_hopper_gemm", False):
        tables.HOPPER_GEMM.clear()
    if "hopper_table" in options:
        from bench.kernels.hopper_gemm import patch_table

        patch_table(options.pop("hopper_table"))
    if "flash_table" in options:
        tables.FRESH_PROMPT_FLASH[:] = [(first, last, tables.FlashConfig(**fields))
                                        for first, last, fields in options.pop("flash_table")]
    if "rope_write_tiled" in options:
        tables.ROPE_KV_WRITE_TILE = options.pop("rope_write_tiled")
    if options.pop("unpacked_batch", False):   # the prompt step's batch split by its own call, as before 2026-11-30
        from jaxinfer.runner.transfer import to_device

        jaxinfer.engine.engine.to_device_packed = to_device
    layout = options.pop("weights", None)
    if layout is not None:
        def split_every_array(params):
            stacked = params["layers"]
            n = jax.tree.leaves(stacked)[0].shape[0]
            return {**params, "layers": [jax.tree.map(lambda a: a[i], stacked) for i in range(n)],
                    "layer_vectors": None}

        arrange = {"stacked": lambda params: params, "split-every-array": split_every_array}[layout]
        load_params = jaxinfer.model.weights.load_params

        def load_arranged(model_dir, cfg, progress=True, per_layer=False):   # the stacked tree, then the layout
            return arrange(load_params(model_dir, cfg, progress=progress))

        jaxinfer.engine.engine.load_params = load_arranged
    if patched:
        options["executable_cache"] = False
    return options

