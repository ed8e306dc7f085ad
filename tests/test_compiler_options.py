"""The XLA options a model's steps compile with (runner/compiler_options.py): XLA's Triton GEMM fusions off for the
steps of a model whose products run XLA's fp8 W8A8 GEMM there (tables.FP8_W8A8_ROWS rows or more), nothing for its
smaller steps or any other model; and that the options reach those steps (an option XLA does not know fails them)."""

import jax
import jax.numpy as jnp
import pytest

from conftest import STORIES
from jaxinfer import LLM, SamplingParams
from jaxinfer.ops.quantized import quantize
from jaxinfer.pallas import tables
from jaxinfer.runner import compiler_options
from jaxinfer.runner.compiler_options import NO_TRITON_GEMM, RowsJit, runs_fp8_w8a8, step_compiler_options
from jaxinfer.runner.split_step import SplitStep


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


def test_rows_jit_takes_the_options_from_min_rows():
    """A step of fewer rows than min_rows compiles without the options, one of min_rows or more with them (an option
    name XLA does not know fails that compile); lower and trace pick as the call does."""
    f = RowsJit(lambda x, y: x * 2 + y, {"xla_not_an_option": False}, 4, lambda x: x.shape[0], batch_arg=0)
    small, large = jnp.ones((2, 3)), jnp.ones((4, 3))
    assert float(f(small, 1.0).sum()) == 18.0
    f.lower(small, 1.0).compile()
    assert f.trace(large, 1.0).jaxpr is not None
    with pytest.raises(Exception, match="xla_not_an_option"):
        f(large, 1.0)
    with pytest.raises(Exception, match="xla_not_an_option"):
        f.lower(large, 1.0).compile()


SPLIT = dict(greedy_mixed_step=True, fresh_prompt_attention=True, fresh_prompt_min_tokens=16,
             prompt_step_head_layers=2, unroll_layers=True)   # a fresh prompt of 16 tokens or more: a SplitStep


@pytest.mark.parametrize("quantization,split", [("fp8", False), (None, False), ("fp8", True)])
def test_the_options_reach_the_steps_of_w8a8_rows(monkeypatch, quantization, split):
    """An option name XLA does not know in place of NO_TRITON_GEMM: an fp8 engine's steps below FP8_W8A8_ROWS rows
    compile without it (two prompts decode at two rows), and its first step of FP8_W8A8_ROWS rows or more fails (so
    the options are passed there); a bf16 engine runs every step (they are passed to no other model). split: one
    sequence's prompt step as two executables (prompt_step_head_layers), each taking the options as the step does."""
    monkeypatch.setattr(compiler_options, "NO_TRITON_GEMM", {"xla_not_an_option": False})
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", 32)

    def generate(prompts):
        llm = LLM(STORIES, ops="pallas-interpret", quantization=quantization, max_num_seqs=2,
                  max_num_batched_tokens=64, progress=False, executable_cache=False,
                  **(SPLIT if split else {}))
        assert llm.engine.runner.compiler_options == ({"xla_not_an_option": False} if quantization else {})
        assert any(isinstance(s, SplitStep) for s in llm.engine.runner.steps.values()) == split
        return llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))

    short = ["once upon a time", "the cat"]                         # prompt steps of a 16-row bucket
    assert [len(o.outputs[0].token_ids) for o in generate(short)] == [4, 4]
    long = ["once upon a time there was a little girl who liked to play in the park with her dog"]
    if quantization:   # XLA's own refusal (JAX's refusal of options on a nested jit names the option too)
        with pytest.raises(Exception, match="No such compile option: 'xla_not_an_option'"):
            generate(long)
    else:
        assert len(generate(long)[0].outputs[0].token_ids) == 4


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


@pytest.mark.parametrize("at_start", [True, False], ids=["compile_all_at_start", "executable_cache"])
def test_an_fp8_engine_compiles_a_split_prompt_step_apart(monkeypatch, tmp_path, at_start):
    """A SplitStep's parts compiled apart (the GPU's defaults: at start, or on first use through the executable
    cache): its tail's input shape is read from the head's own trace, since a step with compiler options may only be
    traced at the top level (jax.eval_shape of it raised: bench/prefill.py's fp8 rows on an H100, 2026-12-06). The
    prompt then runs on the compiled parts."""
    monkeypatch.setattr(tables, "FP8_W8A8_ROWS", 32)
    llm = LLM(STORIES, ops="pallas-interpret", quantization="fp8", max_num_seqs=1, max_num_batched_tokens=64,
              token_buckets=[64], progress=False, cache_dir=str(tmp_path), executable_cache=not at_start,
              compile_all_at_start=at_start, **SPLIT)
    assert llm.engine.runner.compiler_options == NO_TRITON_GEMM
    assert any(isinstance(s, SplitStep) for s in llm.engine.runner.steps.values())
    long = "once upon a time there was a little girl who liked to play in the park with her dog and her cat"
    assert len(llm.generate([long], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids) == 2
