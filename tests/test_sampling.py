"""Tests for jaxinfer.sampling: parameter validation and the properties of on-device sampling."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import SamplingParams, SamplingParamsError
from jaxinfer.sampling.choose import SORT_MAX_ROWS, sampler_for
from jaxinfer.sampling.params import seed_to_u32
from jaxinfer.sampling.sample import (
    SamplingArrays,
    _top_p_keep,
    apply_penalties,
    greedy_with_logprob,
    sample,
    top_k_by_blocks,
    top_logprobs,
)

# --------------------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def jsample():
    """One jitted `sample`; it compiles once per shape and is shared by the whole module."""
    return jax.jit(sample)


@pytest.fixture(scope="module")
def jtop():
    return jax.jit(top_logprobs, static_argnums=1)


N = 4096  # samples for the distribution tests: one row per sample, varying step_index
BUCKETS = (16, 64, N)  # batch sizes are padded to these, as the engine does, to bound compiles


def run(fn, logits, params, seeds=None, steps=None, prompt_mask=None, counts=None):
    """Sample with `fn` (the jitted `sample`); `params` is one SamplingParams or one per row.

    The batch is padded to the next bucket with `from_params`' greedy rows; returns the real rows.
    """
    logits = np.asarray(logits, np.float32)
    B, V = logits.shape
    P = next(b for b in BUCKETS if b >= B)
    if isinstance(params, SamplingParams):
        params = [params] * B
    seeds = list(range(B)) if seeds is None else [int(s) for s in seeds]

    def pad(x, dtype):
        out = np.zeros((P,) + x.shape[1:], dtype)
        out[:B] = x
        return out

    steps = np.zeros(B) if steps is None else np.asarray(steps)
    prompt_mask = np.zeros((B, V)) if prompt_mask is None else np.asarray(prompt_mask)
    counts = np.zeros((B, V)) if counts is None else np.asarray(counts)
    arrays = SamplingArrays.from_params(params, seeds, P)
    tokens, logprob = fn(pad(logits, np.float32), arrays, pad(steps, np.int32), pad(prompt_mask, bool),
                         pad(counts, np.int32))
    chex.assert_shape([tokens, logprob], (P,))
    chex.assert_type([tokens, logprob], [jnp.int32, jnp.float32])
    return np.asarray(tokens)[:B], np.asarray(logprob)[:B]


def repeat_row(row, n):
    return np.tile(np.asarray(row, np.float32)[None, :], (n, 1))


def log_softmax_np(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


KNOWN = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], np.float32))  # ids by prob: 1, 3, 4, 2, 0


# --------------------------------------------------------------------------- validation

INVALID = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("max_tokens", "16"),
    ("max_tokens", None),
    ("temperature", -1),
    ("temperature", -1e-9),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", True),
    ("temperature", "0.5"),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", -0.1),
    ("top_p", 1.0001),
    ("top_p", float("nan")),
    ("top_p", False),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", float("nan")),
    ("min_p", True),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("repetition_penalty", float("nan")),
    ("repetition_penalty", True),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.01),
    ("presence_penalty", float("nan")),
    ("presence_penalty", float("-inf")),
    ("presence_penalty", True),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -3),
    ("frequency_penalty", float("nan")),
    ("frequency_penalty", "0"),
    ("seed", 1.0),
    ("seed", True),
    ("seed", "42"),
    ("stop", 3),
    ("stop", ["ok", 3]),
    ("stop", [""]),
    ("stop", ""),
    ("stop", b"x"),
    ("stop_token_ids", 5),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", [1, 2.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
    ("logprobs", True),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b") as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, SamplingParamsError) and isinstance(info.value, JaxinferError)


VALID = [
    ("max_tokens", 1),
    ("max_tokens", 100_000),
    ("max_tokens", np.int64(8)),
    ("temperature", 0),
    ("temperature", 0.0),
    ("temperature", 1e-30),
    ("temperature", 100.0),
    ("temperature", np.float32(0.5)),
    ("top_p", 1.0),
    ("top_p", 1),
    ("top_p", 1e-9),
    ("top_k", -1),
    ("top_k", 0),
    ("top_k", 1),
    ("top_k", 10**6),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("repetition_penalty", 1e-3),
    ("repetition_penalty", 1),
    ("repetition_penalty", 10.0),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2),
    ("frequency_penalty", -2),
    ("frequency_penalty", 2.0),
    ("seed", None),
    ("seed", 0),
    ("seed", -1),
    ("seed", 2**63),
    ("stop", None),
    ("stop", "\n"),
    ("stop", ["a", "bc"]),
    ("stop", ("a",)),
    ("stop", []),
    ("stop_token_ids", None),
    ("stop_token_ids", []),
    ("stop_token_ids", [0, 2, np.int32(7)]),
    ("ignore_eos", True),
    ("ignore_eos", False),
    ("logprobs", None),
    ("logprobs", 0),
    ("logprobs", 20),
]


@pytest.mark.parametrize("field,value", VALID, ids=[f"{f}={v!r}" for f, v in VALID])
def test_valid_edge_values_are_accepted(field, value):
    SamplingParams(**{field: value})


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == -1
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-30).greedy

    q = SamplingParams(stop="END", temperature=1, top_p=1, max_tokens=np.int64(4))
    assert q.stop == ["END"]
    assert type(q.temperature) is float and type(q.top_p) is float and type(q.max_tokens) is int

    stops, ids = ["a"], [3]
    r = SamplingParams(stop=stops, stop_token_ids=ids)
    stops.append("b")
    ids.append(4)
    assert r.stop == ["a"] and r.stop_token_ids == [3]  # copies, not aliases


def test_from_params_packs_and_pads():
    params = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=-0.5, seed=3),
        SamplingParams(top_k=-1),
    ]
    a = SamplingArrays.from_params(params, [3, -1], 4)
    np.testing.assert_allclose(a.temperature, [0.7, 1.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(a.top_k, [5, 0, 0, 0])
    np.testing.assert_allclose(a.top_p, [0.9, 1, 1, 1], rtol=1e-6)
    np.testing.assert_allclose(a.min_p, [0.1, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(a.repetition_penalty, [1.3, 1, 1, 1], rtol=1e-6)
    np.testing.assert_allclose(a.presence_penalty, [0.5, 0, 0, 0])
    np.testing.assert_allclose(a.frequency_penalty, [-0.5, 0, 0, 0])
    np.testing.assert_array_equal(a.seed, [3, 2**32 - 1, 0, 0])
    chex.assert_shape([a.temperature, a.top_k, a.top_p, a.min_p, a.seed], (4,))
    chex.assert_type([a.temperature, a.top_p, a.min_p, a.repetition_penalty], np.float32)
    chex.assert_type(a.top_k, np.int32)
    chex.assert_type(a.seed, np.uint32)
    assert seed_to_u32(2**32 + 5) == 5

    empty = SamplingArrays.from_params([], [], 2)
    np.testing.assert_array_equal(empty.temperature, [0, 0])
    with pytest.raises(ValueError, match="seeds"):
        SamplingArrays.from_params(params, [1], 4)
    with pytest.raises(ValueError, match="pad_to"):
        SamplingArrays.from_params(params, [1, 2], 1)


# --------------------------------------------------------------------------- greedy


def test_greedy_rows_equal_argmax(jsample):
    logits = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32) * 3
    tokens, _ = run(jsample, logits, SamplingParams(temperature=0))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_greedy_ties_take_the_lowest_index(jsample):
    logits = np.full((5, 64), -9.0, np.float32)
    logits[0, :4] = [1, 3, 3, 2]
    logits[1, :] = 5.0
    logits[2, [6, 7, 40]] = 7.0
    logits[3, :4] = [-1, -1, -0.5, -0.5]
    logits[4, [63, 10]] = [-0.0, 0.0]  # -0.0 == 0.0
    logits[4, :10] = -1.0
    tokens, _ = run(jsample, logits, SamplingParams(temperature=0))
    np.testing.assert_array_equal(tokens, [1, 0, 6, 2, 10])
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    # Sampling rows that keep one token (top_k=1) break ties the same way.
    for step in range(3):
        tokens, _ = run(jsample, logits, SamplingParams(temperature=0.5, top_k=1), steps=np.full(5, step))
        np.testing.assert_array_equal(tokens, [1, 0, 6, 2, 10])


def test_padding_rows_are_greedy(jsample):
    logits = np.random.default_rng(1).normal(size=(16, 64)).astype(np.float32)
    arrays = SamplingArrays.from_params([SamplingParams(temperature=1.0)], [7], 16)
    zeros = jnp.zeros((16, 64), jnp.int32)
    tokens, _ = jsample(logits, arrays, jnp.zeros(16, jnp.int32), zeros.astype(bool), zeros)
    np.testing.assert_array_equal(np.asarray(tokens)[1:], logits.argmax(-1)[1:])


def test_tiny_temperature_is_finite_and_picks_the_top(jsample):
    logits = np.random.default_rng(2).normal(size=(16, 64)).astype(np.float32) * 50
    tokens, logprob = run(jsample, logits, SamplingParams(temperature=1e-30))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    assert np.isfinite(logprob).all()


# --------------------------------------------------------------------------- top-k, top-p, min-p


def test_top_k_1_equals_greedy(jsample):
    logits = np.random.default_rng(3).normal(size=(16, 64)).astype(np.float32)
    for step in range(4):
        tokens, _ = run(jsample, logits, SamplingParams(temperature=1.5, top_k=1), steps=np.full(16, step))
        np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("k", [2, 5])
def test_top_k_samples_only_among_the_k_largest(jsample, k):
    row = np.random.default_rng(4).normal(size=64).astype(np.float32) * 0.3  # flat-ish
    allowed = set(np.argsort(-row)[:k].tolist())
    tokens, _ = run(jsample, repeat_row(row, N), SamplingParams(temperature=2.0, top_k=k),
                    seeds=np.arange(N) % 97, steps=np.arange(N) // 97)
    assert set(tokens.tolist()) == allowed  # never outside, and every one of them drawn


def test_top_k_larger_than_vocab_is_off(jsample):
    tokens, _ = run(jsample, repeat_row(KNOWN, N), SamplingParams(top_k=1000), steps=np.arange(N))
    assert set(tokens.tolist()) == set(range(5))


def test_tiny_top_p_is_argmax(jsample):
    logits = np.random.default_rng(5).normal(size=(16, 64)).astype(np.float32)
    for step in range(4):
        tokens, _ = run(jsample, logits, SamplingParams(temperature=1.0, top_p=1e-6), steps=np.full(16, step))
        np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_top_p_samples_only_the_nucleus(jsample):
    # Exclusive cumulative mass in probability order: 1 -> 0, 3 -> 0.4, 4 -> 0.7: top_p=0.5 keeps {1, 3}.
    tokens, _ = run(jsample, repeat_row(KNOWN, N), SamplingParams(top_p=0.5), steps=np.arange(N))
    assert set(tokens.tolist()) == {1, 3}
    share = np.mean(tokens == 1)
    assert abs(share - 0.4 / 0.7) < 0.04

    tokens, _ = run(jsample, repeat_row(KNOWN, N), SamplingParams(top_p=0.75), steps=np.arange(N))
    assert set(tokens.tolist()) == {1, 3, 4}


def test_min_p_drops_low_tokens(jsample):
    # min_p=0.3 -> threshold 0.3 * 0.4 = 0.12: keeps 1 (0.4), 3 (0.3), 4 (0.15); drops 2 (0.1), 0 (0.05).
    tokens, _ = run(jsample, repeat_row(KNOWN, N), SamplingParams(min_p=0.3), steps=np.arange(N))
    assert set(tokens.tolist()) == {1, 3, 4}
    # min_p=1 keeps only the top token.
    tokens, _ = run(jsample, repeat_row(KNOWN, N), SamplingParams(min_p=1.0), steps=np.arange(N))
    assert set(tokens.tolist()) == {1}


def chi_square(tokens, expected_probs):
    V = len(expected_probs)
    counts = np.bincount(tokens, minlength=V)
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}"
    exp = expected_probs[support] * len(tokens)
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


# 99.9% quantiles of chi-square with df degrees of freedom; outcomes are deterministic (fixed seeds).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize(
    "params,expected",
    [
        (SamplingParams(temperature=1.0), lambda p: p),
        (SamplingParams(temperature=0.5), lambda p: p**2),
        (SamplingParams(temperature=2.0), lambda p: np.sqrt(p)),
        (SamplingParams(temperature=1.0, top_k=3), lambda p: p * (p >= np.sort(p)[-3])),
        (SamplingParams(temperature=1.0, top_p=0.8), lambda p: p * (p >= 0.12)),  # keeps 1, 3, 4
        (SamplingParams(temperature=1.0, min_p=0.3), lambda p: p * (p >= 0.12)),
    ],
    ids=["t1", "t0.5", "t2", "topk3", "topp0.8", "minp0.3"],
)
def test_sampling_frequencies_match_the_distribution(jsample, params, expected):
    p = np.exp(KNOWN.astype(np.float64))
    q = expected(p)
    q = q / q.sum()
    tokens, _ = run(jsample, repeat_row(KNOWN, N), params, seeds=np.full(N, 1234), steps=np.arange(N))
    stat, df = chi_square(tokens, q)
    assert stat < CHI2_999[df], (stat, np.bincount(tokens, minlength=5) / N, q)


def test_frequencies_match_softmax_on_random_logits(jsample):
    row = np.random.default_rng(6).normal(size=5).astype(np.float32)
    tokens, _ = run(jsample, repeat_row(row, N), SamplingParams(temperature=0.8), seeds=np.full(N, 99),
                    steps=np.arange(N))
    q = np.exp(log_softmax_np(row / 0.8))
    stat, df = chi_square(tokens, q)
    assert stat < CHI2_999[df], stat


# --------------------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = jnp.array([[2.0, -1.0, 3.0, -2.0, 0.5]])
    prompt = jnp.array([[True, False, False, False, False]])
    counts = jnp.array([[0, 2, 0, 0, 0]], jnp.int32)
    arrays = SamplingArrays.from_params([SamplingParams(repetition_penalty=2.0)], [0], 1)
    out = np.asarray(apply_penalties(logits, arrays, prompt, counts))
    np.testing.assert_allclose(out, [[1.0, -2.0, 3.0, -2.0, 0.5]])


def test_repetition_penalty_changes_the_greedy_pick(jsample):
    # Row 0: token 0 (logit 2.0) is in the prompt; / 2 -> 1.0 < 1.5, so token 1 wins.
    # Row 1: token 0 (logit -1.0) was generated; * 2 -> -2.0 < -1.5, so token 1 wins
    #        (dividing a negative logit would have made it -0.5 and kept token 0).
    # Row 2: same as row 0 without the penalty: token 0.
    logits = np.full((3, 64), -9.0, np.float32)
    logits[:, :4] = [[2.0, 1.5, -1.0, -1.2], [-1.0, -1.5, -3.0, -4.0], [2.0, 1.5, -1.0, -1.2]]
    prompt = np.zeros((3, 64), bool)
    prompt[0, 0] = True
    counts = np.zeros((3, 64), np.int32)
    counts[1, 0] = 1
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)] * 2 + [SamplingParams(temperature=0)]
    tokens, logprob = run(jsample, logits, params, prompt_mask=prompt, counts=counts)
    np.testing.assert_array_equal(tokens, [1, 1, 0])
    # The logprob stays that of the raw distribution.
    np.testing.assert_allclose(logprob, log_softmax_np(logits)[np.arange(3), tokens], rtol=1e-5)


def test_presence_and_frequency_penalties_follow_openai():
    logits = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    counts = jnp.array([[0, 1, 3, 0], [0, 1, 3, 0]], jnp.int32)
    prompt = jnp.array([[True, False, False, False]] * 2)  # the prompt does not count for these two
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=-2.0)]
    arrays = SamplingArrays.from_params(params, [0, 0], 2)
    out = np.asarray(apply_penalties(logits, arrays, prompt, counts))
    # logit - count * frequency - (count > 0) * presence
    np.testing.assert_allclose(out[0], [1.0, 1.0 - 0.25 - 0.5, 1.0 - 0.75 - 0.5, 1.0])
    np.testing.assert_allclose(out[1], [1.0, 1.0 + 2.0 + 1.0, 1.0 + 6.0 + 1.0, 1.0])


def test_presence_and_frequency_penalties_change_the_pick(jsample):
    logits = repeat_row([3.0, 2.5] + [0.0] * 62, 3)
    counts = repeat_row([2] + [0] * 63, 3).astype(np.int32)
    params = [
        SamplingParams(temperature=0, frequency_penalty=0.3),  # 3 - 0.6 = 2.4 < 2.5 -> 1
        SamplingParams(temperature=0, presence_penalty=0.4),  # 3 - 0.4 = 2.6 > 2.5 -> 0
        SamplingParams(temperature=1.0, top_k=1, presence_penalty=0.6),  # sampling rows too: 2.4 -> 1
    ]
    tokens, _ = run(jsample, logits, params, counts=counts)
    np.testing.assert_array_equal(tokens, [1, 0, 1])


# --------------------------------------------------------------------------- randomness


def test_same_seed_same_tokens_whatever_the_batch(jsample):
    """A request's token depends only on its own row: not its index, not the other rows."""
    rng = np.random.default_rng(7)
    R, V = 32, 64
    logits = rng.normal(size=(R, V)).astype(np.float32)
    seeds = rng.integers(0, 2**32, size=R)
    steps = rng.integers(0, 1000, size=R)
    prompt = rng.random((R, V)) < 0.1
    counts = rng.integers(0, 3, size=(R, V)) * (rng.random((R, V)) < 0.1)
    temps = rng.uniform(0.5, 2.0, size=R)
    params = [SamplingParams(temperature=float(t), top_p=0.95, repetition_penalty=1.1,
                             presence_penalty=0.2, seed=int(s)) for t, s in zip(temps, seeds)]
    ref, ref_lp = run(jsample, logits, params, seeds, steps, prompt, counts)
    assert len(set(ref.tolist())) > 8  # the rows really are sampled

    # Same requests, shuffled, each next to a different filler row, in a batch of another size.
    B = 2 * R
    perm = rng.permutation(R)
    where = 2 * np.arange(R) + 1  # request perm[i] goes to row 2i+1
    logits2 = rng.normal(size=(B, V)).astype(np.float32)
    seeds2 = rng.integers(0, 2**32, size=B)
    steps2 = rng.integers(0, 1000, size=B)
    prompt2 = rng.random((B, V)) < 0.5
    counts2 = rng.integers(0, 3, size=(B, V))
    params2 = [SamplingParams(temperature=3.0, top_k=7, frequency_penalty=1.0) for _ in range(B)]
    logits2[where], seeds2[where], steps2[where] = logits[perm], seeds[perm], steps[perm]
    prompt2[where], counts2[where] = prompt[perm], counts[perm]
    for i, r in enumerate(perm):
        params2[where[i]] = params[r]
    out, out_lp = run(jsample, logits2, params2, seeds2, steps2, prompt2, counts2)
    np.testing.assert_array_equal(out[where], ref[perm])
    np.testing.assert_allclose(out_lp[where], ref_lp[perm], rtol=1e-6)

    # And the same batch twice gives the same tokens.
    again, _ = run(jsample, logits, params, seeds, steps, prompt, counts)
    np.testing.assert_array_equal(again, ref)


def test_different_seeds_and_steps_give_different_samples(jsample):
    row = np.zeros(64, np.float32)
    n = 64
    by_seed, _ = run(jsample, repeat_row(row, n), SamplingParams(), seeds=np.arange(n), steps=np.zeros(n))
    by_step, _ = run(jsample, repeat_row(row, n), SamplingParams(), seeds=np.full(n, 5), steps=np.arange(n))
    same, _ = run(jsample, repeat_row(row, n), SamplingParams(), seeds=np.full(n, 5), steps=np.full(n, 3))
    assert len(set(by_seed.tolist())) > 25  # 64 draws from 64 equally likely tokens: ~40 distinct
    assert len(set(by_step.tolist())) > 25
    assert len(set(same.tolist())) == 1
    assert (by_seed != by_step).any()


# --------------------------------------------------------------------------- logprobs


def test_logprob_is_raw_log_softmax_of_the_token(jsample):
    rng = np.random.default_rng(8)
    B, V = 16, 64
    logits = (rng.normal(size=(B, V)) * 4).astype(np.float32)
    counts = (rng.random((B, V)) < 0.2).astype(np.int32) * 2
    params = [
        SamplingParams(temperature=float(t), top_k=int(k), repetition_penalty=1.5, frequency_penalty=0.7)
        for t, k in zip(rng.choice([0.0, 0.3, 1.0, 1.7], B), rng.choice([-1, 3, 10], B))
    ]
    tokens, logprob = run(jsample, logits, params, steps=np.arange(B), counts=counts)
    np.testing.assert_allclose(logprob, log_softmax_np(logits)[np.arange(B), tokens], rtol=1e-5, atol=1e-5)


def test_top_logprobs(jtop):
    logits = np.random.default_rng(9).normal(size=(4, 64)).astype(np.float32)
    values, ids = jtop(logits, 5)
    chex.assert_shape([values, ids], (4, 5))
    chex.assert_type([values, ids], [jnp.float32, jnp.int32])
    ref = log_softmax_np(logits)
    want = np.argsort(-ref, axis=-1, kind="stable")[:, :5]
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_allclose(values, np.take_along_axis(ref, want, -1), rtol=1e-5, atol=1e-6)

    tied_values, tied_ids = jtop(np.zeros((4, 64), np.float32), 3)
    np.testing.assert_array_equal(tied_ids, [[0, 1, 2]] * 4)
    np.testing.assert_allclose(tied_values, -math.log(64), rtol=1e-6)

    v0, i0 = jtop(logits, 0)
    chex.assert_shape([v0, i0], (4, 0))


@pytest.mark.parametrize("V,k", [(151_936, 20), (5_000, 1), (4_097, 5), (32_000, 20), (300, 20)])
def test_top_k_by_blocks_equals_lax_top_k(V, k):
    rng = np.random.default_rng(V + k)
    smooth = rng.normal(size=(3, V)).astype(np.float32)
    tied = rng.integers(0, 4, size=(3, V)).astype(np.float32)     # many ties at the k-th value
    spiky = np.full((2, V), -1.0, np.float32)                      # every winner in one block, or at the end
    spiky[0, 5:5 + k] = 3.0
    spiky[1, V - k:] = 2.0
    for x in (smooth, tied, spiky, np.concatenate([smooth[:1], -np.abs(tied[:1]) * 1e30])):
        want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
        got_v, got_i = jax.jit(top_k_by_blocks, static_argnums=1)(jnp.asarray(x), k)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_array_equal(got_v, want_v)


# --------------------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    temperature=st.sampled_from([0.0, 0.1, 0.7, 1.0, 5.0]),
    top_k=st.integers(-1, 20),
    top_p=st.sampled_from([1e-6, 0.1, 0.5, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
)
def test_sampled_token_is_always_allowed(jsample, data, temperature, top_k, top_p, min_p):
    """Whatever the settings, the token lies in the top-k of the penalised logits, is never a
    token that min-p rules out, and its logprob is finite."""
    B, V = 16, 64
    seed = data.draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens, logprob = run(jsample, logits, params, seeds=rng.integers(0, 2**32, B), steps=rng.integers(0, 99, B))
    assert np.isfinite(logprob).all()
    rank = (logits > logits[np.arange(B), tokens][:, None]).sum(-1)  # how many beat the token
    if temperature == 0 or top_k == 1 or top_p == 1e-6 or min_p == 1.0:
        np.testing.assert_array_equal(tokens, logits.argmax(-1))
    if top_k > 0:
        assert (rank < top_k).all()
    if temperature > 0 and min_p > 0:
        scaled = logits / temperature
        ratio = np.exp(scaled[np.arange(B), tokens] - scaled.max(-1))
        assert (ratio >= min_p * (1 - 1e-5)).all()


@pytest.mark.parametrize("temps", [[0.0] * 8, [0.0, 0.8, 1.5, 0.0, 0.3, 2.0, 0.0, 1.0]])
def test_without_the_branch_the_same_tokens(jsample, temps):
    """method="sort" (always sort, no device-side conditional) picks what the branching sampler picks,
    for all-greedy batches and for greedy rows beside sampled ones with every filter."""
    rng = np.random.default_rng(11)
    R, V = len(temps), 64
    logits = rng.normal(size=(R, V)).astype(np.float32) * 2
    prompt = rng.random((R, V)) < 0.1
    counts = rng.integers(0, 3, size=(R, V)) * (rng.random((R, V)) < 0.1)
    params = [SamplingParams(temperature=t, top_p=0.9, top_k=20, min_p=0.02, repetition_penalty=1.1,
                             frequency_penalty=0.3, seed=i) for i, t in enumerate(temps)]
    steps = rng.integers(0, 100, size=R)
    want, want_lp = run(jsample, logits, params, None, steps, prompt, counts)
    got, got_lp = run(jax.jit(functools.partial(sample, method="sort")), logits, params, None, steps, prompt, counts)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_lp, want_lp, rtol=1e-6)
    if any(temps):
        assert len(set(want.tolist())) > 3   # sampled rows really sampled


def test_sampler_for_picks_the_cheapest_method():
    assert sampler_for([]) == "plain"
    assert sampler_for([SamplingParams(temperature=0, top_k=5, top_p=0.5), SamplingParams(temperature=0.7, min_p=0.1)]) \
        == "plain"
    assert sampler_for([SamplingParams(temperature=0.7, top_k=20, top_p=0.95), SamplingParams(temperature=1)]) == "filter"
    assert sampler_for([SamplingParams(temperature=0.7, top_k=64)]) == "filter"
    assert sampler_for([SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0.6, top_p=0.9)]) == \
        "filter-p"   # top-p alone: the radix search
    assert sampler_for([SamplingParams(temperature=0.6, top_p=0.9), SamplingParams(temperature=0, top_p=0.5)]) == \
        "filter-p"
    assert sampler_for([SamplingParams(temperature=0.6, top_p=0.9), SamplingParams(temperature=1, top_k=65)]) == "sort"
    assert sampler_for([SamplingParams(temperature=0.7, top_k=65)]) == "sort"
    assert sampler_for([SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1, top_k=100)]) == "sort"
    # the radix search pays only above SORT_MAX_ROWS rows (a step of fewer sorts); the filter without it
    # pays at every row count; plain stays plain
    topk, topp = [SamplingParams(temperature=0.7, top_k=20, top_p=0.95)], [SamplingParams(temperature=0.7, top_p=0.9)]
    rows = (1, SORT_MAX_ROWS, SORT_MAX_ROWS + 1, 64)
    assert [sampler_for(topp, r) for r in rows] == ["sort", "sort", "filter-p", "filter-p"]
    assert [sampler_for(topk, r) for r in rows] == ["filter"] * 4
    assert sampler_for([SamplingParams(temperature=0.7)], 1) == "plain"


def _filter_rows(i: int, top_p_alone: bool) -> dict:
    """Row i's filters for the "filter" tests: none, top-k (1-64) with or without top-p, or (every fourth
    row, with top_p_alone) top-p alone."""
    kind = i % 4
    if kind == 0:
        return {}
    if kind == 3 and top_p_alone:
        return {"top_p": [0.9, 0.5, 0.99, 0.2][(i // 4) % 4]}
    return {"top_k": [1, 7, 20, 64][i % 4], "top_p": [1.0, 0.9, 0.5][i % 3]}


@pytest.mark.parametrize("method", ["plain", "filter", "filter-p"])
def test_without_the_sort_the_same_tokens(jsample, method):
    """The samplers without the sort draw what the sorting sampler draws, for the rows sampler_for gives
    them: temperature, min-p and penalties beside greedy rows; for "filter" also top-k up to
    TOP_K_CANDIDATES with top-p; for "filter-p" top-p alone as well; min-p, and ties among the logits (by lower id, as the stable
    sort). V = 20,000 makes top_k_by_blocks cut the rows into blocks (it does above 2 x 64 blocks of 128)."""
    rng = np.random.default_rng(12)
    R, V = 48, 20_000
    logits = rng.normal(size=(R, V)).astype(np.float32) * 2
    logits[::5, 10:40] = logits[::5, 10:11]      # ties, across the top-k boundary in some rows
    logits[3::8, :] = np.round(logits[3::8, :])  # many ties, across the nucleus's boundary
    prompt = rng.random((R, V)) < 0.1
    counts = rng.integers(0, 3, size=(R, V)) * (rng.random((R, V)) < 0.1)
    params = [SamplingParams(temperature=[0.0, 0.5, 1.0, 1.7][(i // 2) % 4], min_p=[0.0, 0.1][(i // 3) % 2],
                             repetition_penalty=1.1, presence_penalty=0.3, seed=100 + i,
                             **(_filter_rows(i, method == "filter-p") if method != "plain" else {}))
              for i in range(R)]
    assert sampler_for(params) == method
    steps = rng.integers(0, 100, size=R)
    want, want_lp = run(jsample, logits, params, None, steps, prompt, counts)
    got, got_lp = run(jax.jit(functools.partial(sample, method=method)), logits, params, None, steps, prompt, counts)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_lp, want_lp, rtol=1e-6)
    assert len(set(want.tolist())) > 12   # sampled rows really sampled


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.75, 0.95, 0.999])
def test_the_top_p_keep_mask_equals_the_sorted_one(top_p):
    """_top_p_keep (radix search) keeps exactly the tokens the sorted path keeps (float64 here), on rows
    with a peak, flat rows, many ties, a uniform row and one whose mass ends right at a token; it may
    differ only at one token whose mass before it is top_p within float32 rounding."""
    rng = np.random.default_rng(int(top_p * 1000))
    V = 3000
    rows = [rng.normal(size=V) * 3, rng.normal(size=V) * 0.01, np.round(rng.normal(size=V)), np.zeros(V),
            np.log(np.r_[[0.5, 0.25, 0.25], np.full(V - 3, 1e-30)])]
    scaled = np.stack([r - r.max() for r in rows]).astype(np.float32)
    keep = jax.jit(_top_p_keep)
    got = np.asarray(keep(jnp.asarray(scaled), jnp.full(len(rows), top_p, jnp.float32)))
    order = np.lexsort((np.arange(V)[None, :].repeat(len(rows), 0), -scaled), axis=-1)   # stable descending
    for b in range(len(rows)):
        probs = np.exp(scaled[b].astype(np.float64))
        probs /= probs.sum()
        before = np.cumsum(probs[order[b]]) - probs[order[b]]
        want, margin = np.zeros(V, bool), np.zeros(V)
        want[order[b]], margin[order[b]] = before < top_p, np.abs(before - top_p)
        wrong = np.flatnonzero(got[b] != want)
        # only where float32 and float64 sums may fall either side (the uniform row at p = k / V)
        assert len(wrong) <= 1 and (margin[wrong] < 1e-5).all(), (b, wrong, margin[wrong])
        assert got[b].sum() >= 1


@pytest.mark.parametrize("method", ["filter", "filter-p"])
def test_the_filter_samplers_sort_only_the_candidate_blocks(method):
    """The filter samplers' top-k's stay top-k's after XLA's passes: nothing over the vocabulary or the
    8,192 candidates is sorted, only the 64 candidate blocks' indices. (A slice of a top-k's output in
    _filtered_sorted_logits once turned the top-64 of the candidates into a full sort of them.)"""
    import re

    B, V = 2, 20_000
    logits = jnp.zeros((B, V), jnp.float32)
    arrays = jax.tree.map(jnp.asarray, SamplingArrays.from_params(
        [SamplingParams(temperature=0.6, top_k=20, top_p=0.95)] * B, [1, 2], B))
    pm, oc, step = jnp.zeros((B, V), bool), jnp.zeros((B, V), jnp.int32), jnp.zeros(B, jnp.int32)
    text = jax.jit(functools.partial(sample, method=method)).lower(logits, arrays, step, pm, oc).compile().as_text()
    sorted_shapes = {shape for line in text.splitlines() if " sort(" in line
                     for shape in re.findall(r"\w+\[([\d,]+)\]", line.split(" sort(")[0])}
    assert sorted_shapes <= {f"{B},64"}, sorted_shapes


@pytest.mark.parametrize("V", [7, 1000, 151936])
def test_greedy_with_logprob_is_argmax_and_log_softmax(V):
    """The one-pass greedy reduction picks what jnp.argmax picks (the first of equal values; NaN above all;
    a row of -inf gives 0) and the token's log_softmax of the raw logits, penalised and raw rows apart."""
    rng = np.random.default_rng(V)
    raw = jnp.asarray(rng.standard_normal((6, V)) * 4, jnp.float32)
    pen = raw * 0.9
    pen = pen.at[1, V // 2].set(50.0).at[1, V - 1].set(50.0).at[1, 3].set(50.0)   # a three-way tie: the first
    pen = pen.at[2].set(-jnp.inf)                                                  # every entry -inf: index 0
    pen = pen.at[3].set(-jnp.inf).at[3, V - 1].set(-1e30)
    pen = pen.at[4, V - 2].set(jnp.nan).at[4, V - 1].set(jnp.nan)                  # NaN wins, the first of them
    raw = raw.at[5, 2].set(-jnp.inf)                                               # a raw -inf adds nothing
    tokens, logprob = jax.jit(greedy_with_logprob)(raw, pen)
    want = jnp.argmax(pen, axis=-1)
    chex.assert_shape([tokens, logprob], (6,))
    chex.assert_type([tokens, logprob], [jnp.int32, jnp.float32])
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
    ref = jnp.take_along_axis(jax.nn.log_softmax(raw, axis=-1), want[:, None], axis=-1)[:, 0]
    chex.assert_trees_all_close(logprob, ref, rtol=1e-5, atol=1e-5)
