"""Speculative verify's acceptance (sampling/rejection.py) on the GPU at real shapes, against sequential `sample`.

Runs only where JAX sees a GPU:
    PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_rejection_gpu.py
Qwen3's vocabulary (151,936), B x Q = 64 x 8 and 128 x 8 (1,024 rows), fresh random logits, penalties on:
- test_greedy: verify (greedy_only and the sampling path) commits what greedy `sample` gives row after row;
- test_one_hot_drafts: sampled rows (temperature, top-k 20 / top-p 0.95, top-p alone, min-p), each with the
  method sampler_for picks: verify commits what `sample` with the same seeds and steps gives row after row;
- test_draft_probs: with a draft distribution, every committed token has target probability > 0, rows
  without drafts commit `sample`'s token, and the acceptance rate is that of the rule's expectation
  (sum over tokens of min(p, q)) within 5 standard errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.choose import sampler_for
from jaxinfer.sampling.rejection import target_probs, verify
from jaxinfer.sampling.sample import SamplingArrays, sample

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

V = 151_936
SHAPES = [(64, 8), (128, 8)]


def _inputs(seed, B, Q):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    logits = jax.random.normal(k[0], (B, Q, V)) * 3
    prompt_mask = jax.random.uniform(k[1], (B, V)) < 0.001
    counts = (jax.random.uniform(k[2], (B, V)) < 0.001).astype(jnp.int32)
    return logits, prompt_mask, counts, k[3]


def _sequential(logits, arrays, steps, prompt_mask, counts, rng, method):
    """Drafts matching sample's token at each row with probability 0.7, and sample's tokens [B, Q]."""
    B, Q, _ = logits.shape
    jsample = jax.jit(sample, static_argnames="method")
    drafts = np.zeros((B, Q - 1), np.int32)
    picked = np.zeros((B, Q), np.int32)
    c = np.array(counts)
    for j in range(Q):
        tok, _ = jsample(logits[:, j], arrays, steps + j, prompt_mask, jnp.asarray(c), method=method)
        picked[:, j] = np.asarray(tok)
        if j < Q - 1:
            drafts[:, j] = np.where(rng.random(B) < 0.7, picked[:, j], (picked[:, j] + 1) % V)
            c[np.arange(B), drafts[:, j]] += 1
    return drafts, picked


def _expected(drafts, picked):
    B, Q = picked.shape
    a = np.array([next((j for j in range(Q - 1) if drafts[b, j] != picked[b, j]), Q - 1) for b in range(B)])
    return a, np.where(np.arange(Q)[None, :] <= a[:, None], picked, 0)


@pytest.mark.parametrize("B,Q", SHAPES)
def test_greedy(B, Q):
    logits, pm, counts, _ = _inputs(0, B, Q)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5)] * B
    arrays = SamplingArrays.from_params(params, list(range(B)), B)
    steps = jnp.zeros(B, jnp.int32)
    drafts, picked = _sequential(logits, arrays, steps, pm, counts, np.random.default_rng(0), "branch")
    want_a, want_tokens = _expected(drafts, picked)
    nd = jnp.full((B,), Q - 1, jnp.int32)
    for greedy_only in (True, False):
        a, tokens, _ = jax.jit(verify, static_argnames="greedy_only")(logits, drafts, nd, arrays, steps, pm, counts,
                                                                      greedy_only=greedy_only)
        np.testing.assert_array_equal(np.asarray(a), want_a)
        np.testing.assert_array_equal(np.asarray(tokens), want_tokens)


ROWS = {
    "temperature": dict(temperature=0.8, min_p=0.05),
    "top-k / top-p": dict(temperature=0.6, top_k=20, top_p=0.95),
    "top-p": dict(temperature=0.6, top_p=0.9),
}


@pytest.mark.parametrize("B,Q", SHAPES)
@pytest.mark.parametrize("rows", list(ROWS))
def test_one_hot_drafts(B, Q, rows):
    logits, pm, counts, _ = _inputs(1, B, Q)
    params = [SamplingParams(**ROWS[rows], presence_penalty=0.5)] * B
    method = sampler_for(params, B * Q)
    arrays = SamplingArrays.from_params(params, list(range(1000, 1000 + B)), B)
    steps = jnp.arange(B, dtype=jnp.int32)
    drafts, picked = _sequential(logits, arrays, steps, pm, counts, np.random.default_rng(1), method)
    want_a, want_tokens = _expected(drafts, picked)
    a, tokens, _ = jax.jit(verify, static_argnames="method")(logits, drafts, jnp.full((B,), Q - 1, jnp.int32), arrays,
                                                             steps, pm, counts, method=method)
    np.testing.assert_array_equal(np.asarray(a), want_a)
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens)


@pytest.mark.parametrize("B,Q", SHAPES)
def test_draft_probs(B, Q):
    logits, pm, counts, key = _inputs(2, B, Q)
    params = [SamplingParams(**ROWS["top-k / top-p"])] * B
    arrays = SamplingArrays.from_params(params, list(range(B)), B)
    steps = jnp.zeros(B, jnp.int32)
    # q: the target's logits at a higher temperature, so drafts are often but not always accepted
    q = jax.nn.softmax(logits[:, :-1] / 1.5, axis=-1)
    drafts = jax.random.categorical(key, jnp.log(q), axis=-1).astype(jnp.int32)
    nd = jnp.where(jnp.arange(B) % 4 == 0, 0, Q - 1).astype(jnp.int32)     # every fourth row without drafts
    a, tokens, _ = jax.jit(verify, static_argnames="method")(logits, drafts, nd, arrays, steps, pm, counts, q,
                                                             method="filter")
    a, tokens = np.asarray(a), np.asarray(tokens)
    # each row's target distribution with the drafts before it counted
    c = np.array(counts)[:, None, :].repeat(Q, axis=1)
    d = np.asarray(drafts)
    for j in range(1, Q):
        c[np.arange(B), j:, d[:, j - 1]] += 1
    rows = lambda x: jnp.repeat(x, Q, axis=0)
    p = np.asarray(jax.jit(target_probs)(logits.reshape(B * Q, V), jax.tree.map(rows, arrays), rows(pm),
                                         jnp.asarray(c.reshape(B * Q, V)))).reshape(B, Q, V)
    committed = np.arange(Q)[None, :] <= a[:, None]
    assert np.all(p[np.arange(B)[:, None], np.arange(Q)[None, :], tokens][committed] > 0)
    want, _ = jax.jit(sample)(logits[:, 0], arrays, steps, pm, counts)
    no_drafts = np.asarray(nd) == 0
    np.testing.assert_array_equal(tokens[no_drafts, 0], np.asarray(want)[no_drafts])
    # first draft's acceptance: the rule accepts with probability sum_v min(p_0, q_0)
    rate = np.sum(np.minimum(p[:, 0], np.asarray(q[:, 0])), axis=-1)[~no_drafts]
    accepted = (a > 0)[~no_drafts]
    se = np.sqrt(np.sum(rate * (1 - rate)))
    assert abs(accepted.sum() - rate.sum()) < 5 * se + 1, (accepted.sum(), rate.sum(), se)
