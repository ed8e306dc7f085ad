"""The XLA options a model's steps compile with, chosen from what the model holds and the rows a step runs."""

from __future__ import annotations

from typing import Any, Callable

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
    """jax.jit's compiler_options for the steps of a model with these parameters whose products run XLA's fp8 W8A8
    GEMM (tables.FP8_W8A8_ROWS token rows or more): NO_TRITON_GEMM where the model has such products
    (runs_fp8_w8a8), else none (every other model compiles as it always has)."""
    return dict(NO_TRITON_GEMM) if runs_fp8_w8a8(params) else {}


class RowsJit:
    """A step jitted twice: compiled with `options` for batches of `min_rows` token rows or more (their fp8 products
    run XLA's W8A8 GEMM), without them below. Below, the products are XLA's converted values (fp8 to bf16), which XLA
    fuses into its Triton GEMMs reading one byte a weight; without the fusions it writes a bf16 copy of each matrix
    first, ~5 bytes a weight (inferred from fp8 batch 64 end to end on an H100, 2026-12-06, whose last steps run 2-62
    rows: 12.0-12.3 ms a step with the option on every step, 8.7 without W8A8). Called, lowered and traced as the
    jitted step is; the batch is argument `batch_arg` and `rows_of(batch)` its rows."""

    def __init__(self, fn: Callable, options: dict[str, Any], min_rows: int, rows_of: Callable[[Any], int],
                 batch_arg: int = 3, **jit_kw):
        self.with_options = jax.jit(fn, compiler_options=options, **jit_kw)
        self.without = jax.jit(fn, **jit_kw)
        self.min_rows, self.rows_of, self.batch_arg = min_rows, rows_of, batch_arg

    def pick(self, args: tuple):
        """The jitted step these arguments run."""
        return self.with_options if self.rows_of(args[self.batch_arg]) >= self.min_rows else self.without

    def __call__(self, *args):
        return self.pick(args)(*args)

    def lower(self, *args):
        return self.pick(args).lower(*args)

    def trace(self, *args):
        return self.pick(args).trace(*args)


def step_jit(options: dict[str, Any], rows_of: Callable[[Any], int]) -> Callable[..., Any]:
    """jit(fn, batch_arg=3, **jax.jit's keywords) for a model's steps, given its step_compiler_options: jax.jit where
    there are none, else a RowsJit taking them from tables.FP8_W8A8_ROWS rows."""
    if not options:
        return lambda fn, batch_arg=3, **kw: jax.jit(fn, **kw)
    return lambda fn, batch_arg=3, **kw: RowsJit(fn, options, tables.FP8_W8A8_ROWS, rows_of, batch_arg, **kw)
