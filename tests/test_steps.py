"""The pure step functions through the runner: every compiled variant's outputs have the shapes and dtypes its
callers read (chex), on inert batches of each bucket."""

import chex
import jax.numpy as jnp
import pytest

from conftest import STORIES
from jaxinfer.model.config import load_config
from jaxinfer.model.weights import load_params
from jaxinfer.ops import get_ops
from jaxinfer.runner.batch import DecodeBatch
from jaxinfer.runner.model_runner import ModelRunner, bucket_of
from jaxinfer.runner.variants import StepVariant, choose_sampler
from jaxinfer.sampling import SamplingParams
from jaxinfer.settings import EngineConfig


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg = load_config(STORIES)
    config = EngineConfig.from_options(max_num_seqs=4, max_num_batched_tokens=32, decode_steps=3, max_logprobs=5,
                                       plain_sampling_step=True, greedy_mixed_step=True, enable_prompt_logprobs=True,
                                       fresh_prompt_attention=True, fresh_prompt_min_tokens=32,
                                       prefixed_chunk_attention=True).resolved("cpu", False)
    r = ModelRunner(cfg, load_params(STORIES, cfg, progress=False), get_ops("reference"), config, num_pages=17,
                    max_model_len=64)
    r.warmup(progress=False, compile=False)
    return r


def test_every_variant_returns_what_its_callers_read(runner):
    seen = set()
    for variant, batch in runner.bucket_calls():
        if variant.name in seen:   # each variant at its smallest bucket
            continue
        seen.add(variant.name)
        k = variant.n_top(runner.max_logprobs)
        if isinstance(batch, DecodeBatch):
            B, n = bucket_of(batch), variant.steps
            tokens, logprobs, emitted, top_v, top_i = runner.run_decode(batch, variant)
            chex.assert_shape([tokens, logprobs, emitted], (n, B))
            chex.assert_shape([top_v, top_i], (n, B, k))
            assert (tokens.dtype, logprobs.dtype, emitted.dtype, top_i.dtype) == \
                (jnp.int32, jnp.float32, jnp.bool_, jnp.int32)
            continue
        T = bucket_of(batch)
        out = runner.run_mixed(batch, variant)
        B = 1 if variant.one_sequence else runner.max_num_seqs
        chex.assert_shape(out[:2], (B,))
        chex.assert_shape(out[2:4], (B, k))
        assert (out[0].dtype, out[1].dtype, out[3].dtype) == (jnp.int32, jnp.float32, jnp.int32)
        if variant.phase == "prompt-logprobs":   # and every row's next-token logprob and top ones
            chex.assert_shape(out[4], (T,))
            chex.assert_shape(out[5:7], (T, runner.max_logprobs))
    assert {"mixed-greedy", "mixed-plain-fresh", "mixed-prefixed", "prompt-logprobs", "decode-greedy-3",
            "decode-plain-notop-3", "decode-filter-3"} <= seen


@pytest.mark.parametrize("params, decode, want", [
    ([SamplingParams(temperature=0)], True, "greedy"),
    ([SamplingParams(temperature=0, logprobs=2)], True, "plain"),
    ([SamplingParams(temperature=0.7)], True, "plain-notop"),
    ([SamplingParams(temperature=0.7)], False, "plain"),
    ([SamplingParams(temperature=0.7, top_k=20)], True, "filter"),
    ([SamplingParams(temperature=0.7, top_k=100)], True, "sort"),
])
def test_the_host_picks_the_sampler(params, decode, want):
    assert choose_sampler(params, rows=4, plain_sampling=True, decode=decode) == want
    assert choose_sampler(params, rows=4, plain_sampling=False, decode=decode) in ("greedy", "branch")


def test_a_variant_is_a_typed_value():
    v = StepVariant("decode", "plain-notop", steps=8)
    assert v.name == "decode-plain-notop-8" and v.method == "plain" and v.n_top(20) == 0 and not v.one_sequence
    assert StepVariant("mixed", "greedy", "fresh").name == "mixed-greedy-fresh"
    assert {v: 1}[StepVariant("decode", "plain-notop", steps=8)] == 1   # hashable, by value
    with pytest.raises(ValueError, match="no such step variant"):
        StepVariant("mixed", "argmax")
