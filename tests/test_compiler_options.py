"""The XLA options a model's steps compile with (runner/compiler_options.py): XLA's Triton GEMM fusions off for a
model whose products run XLA's fp8 W8A8 GEMM, nothing for any other model; and that the options reach every step
an engine compiles (an option XLA does not know fails the engine's start)."""

import jax
import jax.numpy as jnp
import pytest

from conftest import STORIES
from jaxinfer import LLM, SamplingParams
from jaxinfer.ops.quantized import quantize
from jaxinfer.pallas import tables
from jaxinfer.runner import compiler_options
from jaxinfer.runner.compiler_options import NO_TRITON_GEMM, runs_fp8_w8a8, step_compiler_options


def params_with(w) -> dict:
    return {"embed": jnp.zeros((8, 4), jnp.bfloat16), "layers": {"wqkv": w}}


def test_fp8_per_channel_weights_compile_without_triton_gemm(monkeypatch):
    w = jax.random.normal(jax.random.key(0), (2, 32, 16))
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", 64)
    assert step_compiler_options(params_with(quantize(w, "fp8"))) == {"xla_gpu_enable_triton_gemm": False}
    assert step_compiler_options(params_with(quantize(w, "int8"))) == {}
    assert step_compiler_options(params_with(w.astype(jnp.bfloat16))) == {}
    block_scaled = quantize(w, "fp8")
    block_scaled = type(block_scaled)(block_scaled.values, jnp.ones((2, 1, 1)), (32, 16))
    assert not runs_fp8_w8a8(params_with(block_scaled))   # block scales: converted values, never W8A8
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", None)   # W8A8 off: nothing changes
    assert step_compiler_options(params_with(quantize(w, "fp8"))) == {}


@pytest.mark.parametrize("quantization", ["fp8", None])
def test_the_options_reach_every_step_the_engine_compiles(monkeypatch, quantization):
    """An option name XLA does not know in place of NO_TRITON_GEMM: an fp8 engine fails at its first compile (so the
    options are passed), a bf16 engine starts and generates (so they are passed to no other model)."""
    monkeypatch.setattr(compiler_options, "NO_TRITON_GEMM", {"xla_not_an_option": False})
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", 64)

    def generate():
        llm = LLM(STORIES, ops="pallas-interpret", quantization=quantization, max_num_seqs=2,
                  max_num_batched_tokens=64, progress=False, executable_cache=False)
        assert llm.engine.runner.compiler_options == ({"xla_not_an_option": False} if quantization else {})
        return llm.generate(["once upon a time"], SamplingParams(max_tokens=4, temperature=0))[0]

    if quantization:
        with pytest.raises(Exception, match="xla_not_an_option"):
            generate()
    else:
        assert len(generate().outputs[0].token_ids) == 4


def test_an_fp8_engine_generates_with_the_options_on_the_cpu(monkeypatch):
    """The real option on the CPU (which ignores it): the fp8 engine starts and gives the tokens it gives without it."""
    def tokens():
        llm = LLM(STORIES, ops="pallas-interpret", quantization="fp8", max_num_seqs=2, max_num_batched_tokens=64,
                  progress=False, executable_cache=False)
        out = llm.generate(["once upon a time"], SamplingParams(max_tokens=8, temperature=0))[0]
        return llm.engine.runner.compiler_options, out.outputs[0].token_ids

    options, with_options = tokens()
    assert options == NO_TRITON_GEMM
    monkeypatch.setattr(compiler_options, "NO_TRITON_GEMM", {})
    assert tokens() == ({}, with_options)
