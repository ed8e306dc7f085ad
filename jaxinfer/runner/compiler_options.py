"""The XLA options a model's steps compile with, chosen from what the model holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.quantized import QuantizedWeight
from jaxinfer.pallas import tables

# XLA's Triton GEMM fusions off: every GEMM XLA emits goes to cuBLAS / cuBLASLt (a GPU option; other backends ignore
# it). With the fusions on, XLA autotunes a Triton fusion of each fp8 W8A8 dot with its scales: an engine with an 8k
# prompt step took over 300 s to start (H200, 2026-12-05); with them off 29-32 s, its prompts as fast or faster
# (H100, 2026-12-06: 8k 1.19x bf16, 1k 1.16x; 1k with the fusions on 1.19x).
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def runs_fp8_w8a8(params) -> bool:
    """Whether some product of the model runs XLA's fp8 W8A8 GEMM: fp8 weights with a scale per output channel
    (block-scaled ones are converted, not W8A8) while tables.FP8_W8A8_ROWS is set."""
    if tables.FP8_W8A8_ROWS is None:
        return False
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda a: isinstance(a, QuantizedWeight))
    return any(isinstance(a, QuantizedWeight) and a.block is None and a.dtype == jnp.float8_e4m3fn for a in leaves)


def step_compiler_options(params) -> dict[str, bool]:
    """jax.jit's compiler_options for the steps of a model with these parameters: NO_TRITON_GEMM where XLA's fp8
    W8A8 GEMMs run (runs_fp8_w8a8), else none (every other model compiles as it always has)."""
    return dict(NO_TRITON_GEMM) if runs_fp8_w8a8(params) else {}
