"""Tests for jaxinfer.sampling.rejection: the target distributions, verify's agreement with sequential
`sample` (greedy and seeded), and a chi-square test that speculative sampling is lossless."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2   # scipy comes with jax (a dependency of it)

from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.choose import sampler_for
from jaxinfer.sampling.rejection import target_probs, verify
from jaxinfer.sampling.sample import SamplingArrays, sample

# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def jverify():
    """The jitted `verify`, always called the same way (jit's cache keys on how the arguments are passed)."""
    jitted = jax.jit(verify, static_argnames="greedy_only")
    return lambda *args, draft_probs=None, greedy_only=False: jitted(*args, draft_probs, greedy_only=greedy_only)


@pytest.fixture(scope="module")
def jsample():
    return jax.jit(sample)


@pytest.fixture(scope="module")
def jtarget():
    return jax.jit(target_probs)


def reference_probs(logits, p: SamplingParams, prompt_mask, counts):
    """The target distribution in float64 numpy, written from the definitions; also the distance of the
    top-p and min-p tests from their thresholds (a float32 run may decide a token closer than that the
    other way)."""
    x = np.asarray(logits, np.float64)
    counts = np.asarray(counts)
    rep = p.repetition_penalty
    x = np.where(np.asarray(prompt_mask) | (counts > 0), np.where(x > 0, x / rep, x * rep), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    out = np.zeros_like(x)
    if p.temperature == 0:
        out[np.argmax(x)] = 1.0
        return out, np.inf
    order = np.argsort(-x, kind="stable")
    s = (x[order] - x[order[0]]) / p.temperature
    keep = np.ones(len(x), bool)
    if p.top_k > 0:
        keep[p.top_k:] = False
    probs = np.exp(s) * keep / np.sum(np.exp(s) * keep)
    mass_before = np.cumsum(probs) - probs
    margin = np.inf
    if p.top_p < 1:
        keep &= mass_before < p.top_p
        margin = np.min(np.abs(mass_before - p.top_p)[probs > 0])
    if p.min_p > 0:
        keep &= np.exp(s) >= p.min_p
        margin = min(margin, np.min(np.abs(np.exp(s) - p.min_p)))
    keep[0] = True
    w = np.exp(s) * keep
    out[order] = w / w.sum()
    return out, margin


def arrays_for(params, seeds):
    return SamplingArrays.from_params(params, seeds, len(params))


def log_softmax_np(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def counts_with(counts, tokens, V):
    """counts [B, V] plus one per entry of tokens [B, k] (entries outside 0..V-1 ignored)."""
    out = np.array(counts, np.int32)
    for b, row in enumerate(tokens):
        for t in row:
            if 0 <= t < V:
                out[b, t] += 1
    return out


B_, V_ = 16, 64   # the exact tests' batch and vocabulary: one shape, so they share compiled programs
MIXED_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.1, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.7),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5),
]


# --------------------------------------------------------------------------- target_probs


def test_target_probs_match_the_definitions(jtarget):
    rng = np.random.default_rng(0)
    params = MIXED_PARAMS * 2
    N, V = B_, V_
    logits = rng.normal(size=(N, V)).astype(np.float32) * 2
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1.0             # a greedy tie: the lower id wins
    prompt_mask = rng.random((N, V)) < 0.2
    counts = rng.integers(0, 3, (N, V)) * (rng.random((N, V)) < 0.3)
    probs = np.asarray(jtarget(logits, arrays_for(params, range(N)), prompt_mask, counts))
    for n, p in enumerate(params):
        want, margin = reference_probs(logits[n], p, prompt_mask[n], counts[n])
        assert margin > 1e-4, f"row {n}: a filter decides too close to its threshold for a float32 comparison"
        np.testing.assert_allclose(probs[n], want, atol=2e-6, err_msg=f"row {n}: {p}")
    assert probs[0, 3] == 1.0


def test_sampled_tokens_lie_in_the_target_support(jsample, jtarget):
    """`sample`'s draws over many steps land only where target_probs is positive, for every method's row."""
    rng = np.random.default_rng(1)
    params = MIXED_PARAMS * 2
    logits = rng.normal(size=(B_, V_)).astype(np.float32) * 2
    pm, counts = rng.random((B_, V_)) < 0.2, (rng.integers(0, 3, (B_, V_)) * (rng.random((B_, V_)) < 0.2)).astype(np.int32)
    arrays = arrays_for(params, range(B_))
    probs = np.asarray(jtarget(logits, arrays, pm, counts))
    for step in range(32):
        tokens, _ = jsample(logits, arrays, np.full(B_, step, np.int32), pm, counts)
        assert np.all(probs[np.arange(B_), np.asarray(tokens)] > 0)


# --------------------------------------------------------------------------- verify == sequential sample


def sequential(jsample, logits, params, seeds, steps, prompt_mask, counts, num_drafts, rng, match):
    """Drafts that match `sample`'s sequential tokens with probability `match` at each position, and the
    tokens sequential decoding commits: (drafts [B, Q-1], picked [B, Q]: sample's token at each row, with
    the drafts before it counted as output)."""
    B, Q, V = logits.shape
    arrays = arrays_for(params, seeds)
    drafts = np.full((B, Q - 1), -1, np.int32)
    picked = np.zeros((B, Q), np.int32)
    for j in range(Q):
        c = counts_with(counts, drafts[:, :j], V)
        tok, _ = jsample(logits[:, j], arrays, (steps + j).astype(np.int32), prompt_mask, c)
        picked[:, j] = np.asarray(tok)
        if j < Q - 1:
            other = (picked[:, j] + rng.integers(1, V, B)) % V
            drafts[:, j] = np.where(rng.random(B) < match, picked[:, j], other)
            # padding past num_drafts: garbage, out-of-range ids included
            drafts[:, j] = np.where(j < num_drafts, drafts[:, j], rng.choice([-3, 0, 5, V + 7], B))
    return drafts, picked


def expected_commit(drafts, picked, num_drafts):
    B, Q = picked.shape
    a = np.zeros(B, np.int32)
    for b in range(B):
        while a[b] < num_drafts[b] and drafts[b, a[b]] == picked[b, a[b]]:
            a[b] += 1
    tokens = np.where(np.arange(Q)[None, :] <= a[:, None], picked, 0)
    return a, tokens


@pytest.mark.parametrize("Q,penalties", [(1, False), (4, False), (1, True), (4, True)])
@pytest.mark.parametrize("mode", ["greedy_only", "greedy", "greedy_with_draft_probs"])
def test_greedy_verify_equals_sequential_greedy(jsample, jverify, Q, penalties, mode):
    B, V = B_, V_
    rng = np.random.default_rng(Q * 10 + penalties)
    logits = rng.normal(size=(B, Q, V)).astype(np.float32)
    logits[0, :, 2] = logits[0, :, 9] = 10.0                           # ties -> the lowest id
    p = SamplingParams(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.5) \
        if penalties else SamplingParams(temperature=0.0)
    params, seeds = [p] * B, list(range(B))
    steps = rng.integers(0, 100, B).astype(np.int32)
    prompt_mask = rng.random((B, V)) < (0.2 if penalties else 0.0)
    counts = (rng.integers(0, 3, (B, V)) * (rng.random((B, V)) < 0.2)).astype(np.int32)
    num_drafts = rng.integers(0, Q, B).astype(np.int32)
    drafts, picked = sequential(jsample, logits, params, seeds, steps, prompt_mask, counts, num_drafts, rng, 0.7)
    want_a, want_tokens = expected_commit(drafts, picked, num_drafts)

    draft_probs = jax.nn.softmax(rng.normal(size=(B, Q - 1, V)), axis=-1) if mode == "greedy_with_draft_probs" else None
    a, tokens, logprobs = jverify(logits, drafts, num_drafts, arrays_for(params, seeds), steps, prompt_mask, counts,
                                  draft_probs=draft_probs, greedy_only=mode == "greedy_only")
    np.testing.assert_array_equal(np.asarray(a), want_a)
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
    want_lp = np.take_along_axis(log_softmax_np(logits), want_tokens[:, :, None], axis=-1)[:, :, 0]
    want_lp = np.where(np.arange(Q)[None, :] <= want_a[:, None], want_lp, 0.0)
    np.testing.assert_allclose(np.asarray(logprobs), want_lp, atol=2e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_one_hot_drafts_commit_what_sequential_sampling_gives(jsample, jverify, seed):
    """Without draft probabilities each row takes the token `sample` takes there with the same seed and
    step, so the committed text is that of plain sampling, whichever drafts were proposed."""
    B, Q, V = B_, 4, V_
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, Q, V)).astype(np.float32) * 1.5
    params = (MIXED_PARAMS * B)[:B]
    seeds = list(rng.integers(0, 2**32, B))
    steps = rng.integers(0, 1000, B).astype(np.int32)
    prompt_mask = rng.random((B, V)) < 0.2
    counts = (rng.integers(0, 3, (B, V)) * (rng.random((B, V)) < 0.2)).astype(np.int32)
    num_drafts = rng.integers(0, Q, B).astype(np.int32)
    drafts, picked = sequential(jsample, logits, params, seeds, steps, prompt_mask, counts, num_drafts, rng, 0.6)
    want_a, want_tokens = expected_commit(drafts, picked, num_drafts)
    a, tokens, logprobs = jverify(logits, drafts, num_drafts, arrays_for(params, seeds), steps, prompt_mask, counts)
    np.testing.assert_array_equal(np.asarray(a), want_a)
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
    assert 0 < np.sum(want_a) < np.sum(num_drafts)     # some drafts accepted, some rejected


@pytest.mark.parametrize("Q", [1, 4])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_no_drafts_gives_sample_token_and_logprob(jsample, jverify, Q, with_draft_probs):
    rng = np.random.default_rng(Q)
    B, V = B_, V_
    params = MIXED_PARAMS * 2
    logits = rng.normal(size=(B, Q, V)).astype(np.float32) * 2
    seeds = list(rng.integers(0, 2**32, B))
    steps = rng.integers(0, 1000, B).astype(np.int32)
    prompt_mask = rng.random((B, V)) < 0.2
    counts = (rng.integers(0, 3, (B, V)) * (rng.random((B, V)) < 0.2)).astype(np.int32)
    arrays = arrays_for(params, seeds)
    drafts = rng.integers(0, V, (B, Q - 1)).astype(np.int32)
    draft_probs = jax.nn.softmax(rng.normal(size=(B, Q - 1, V)), axis=-1) if with_draft_probs else None
    a, tokens, logprobs = jverify(logits, drafts, np.zeros(B, np.int32), arrays, steps, prompt_mask, counts,
                                  draft_probs=draft_probs)
    want_tok, want_lp = jsample(logits[:, 0], arrays, steps, prompt_mask, counts)
    assert np.all(np.asarray(a) == 0)
    np.testing.assert_array_equal(np.asarray(tokens)[:, 0], np.asarray(want_tok))
    np.testing.assert_allclose(np.asarray(logprobs)[:, 0], np.asarray(want_lp), atol=1e-6)
    assert np.all(np.asarray(tokens)[:, 1:] == 0) and np.all(np.asarray(logprobs)[:, 1:] == 0)
    sampled = np.array([p.temperature > 0 for p in params])
    assert np.any((np.asarray(tokens)[:, 0] != np.argmax(logits[:, 0], axis=-1))[sampled])   # not all argmax


@functools.cache
def verify_by(method):
    return jax.jit(functools.partial(verify, method=method))


@functools.cache
def target_by(method):
    return jax.jit(functools.partial(target_probs, method=method))


@pytest.mark.parametrize("method", ["plain", "filter", "filter-p"])
def test_methods_without_the_sort_give_the_same_tokens(method):
    """verify's and target_probs' methods without the sort give what the sort gives, for the rows
    sampler_for gives them (V = 20,000: top_k_by_blocks cuts the rows into blocks); ties among the logits
    across the top-k and nucleus boundaries."""
    rng = np.random.default_rng(5)
    B, Q, V = 8, 3, 20_000
    logits = rng.normal(size=(B, Q, V)).astype(np.float32) * 2
    logits[::3, :, 10:40] = logits[::3, :, 10:11]
    logits[1::4] = np.round(logits[1::4])

    def filters(i):
        if method == "plain" or i % 4 == 0:
            return {}
        if i % 4 == 3 and method == "filter-p":
            return {"top_p": [0.9, 0.5][i // 4 % 2]}
        return {"top_k": [1, 7, 20, 64][i % 4], "top_p": [1.0, 0.9, 0.5][i % 3]}

    params = [SamplingParams(temperature=[0.0, 0.7, 1.3][i % 3], min_p=[0.0, 0.05][i // 2 % 2],
                             repetition_penalty=1.2, frequency_penalty=0.4, **filters(i)) for i in range(B)]
    assert sampler_for(params) == method
    arrays = arrays_for(params, list(range(B)))
    prompt_mask = rng.random((B, V)) < 0.1
    counts = (rng.integers(0, 3, (B, V)) * (rng.random((B, V)) < 0.1)).astype(np.int32)
    drafts = np.argmax(logits[:, :-1], axis=-1).astype(np.int32)      # likely accepted: rows past 0 matter
    args = (logits, drafts, np.full(B, Q - 1, np.int32), arrays, np.zeros(B, np.int32), prompt_mask, counts)
    for w, g in zip(verify_by(method="sort")(*args), verify_by(method=method)(*args)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    flat = (logits[:, 0], arrays, prompt_mask, counts)   # the filters' output, which draft_probs' path uses too
    np.testing.assert_array_equal(np.asarray(target_by(method=method)(*flat)),
                                  np.asarray(target_by(method="sort")(*flat)))


# --------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_seeds_reproduce_and_differ_and_rows_are_independent(jverify, with_draft_probs):
    rng = np.random.default_rng(7)
    B, Q, V = B_, 4, V_
    logits = rng.normal(size=(B, Q, V)).astype(np.float32)
    params = [SamplingParams(temperature=1.5)] * B
    steps = rng.integers(0, 100, B).astype(np.int32)
    pm, counts = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
    drafts = rng.integers(0, V, (B, Q - 1)).astype(np.int32)
    num_drafts = np.full(B, Q - 1, np.int32)
    draft_probs = jax.nn.softmax(rng.normal(size=(B, Q - 1, V)), axis=-1) if with_draft_probs else None

    def run(seeds, perm=np.arange(B)):
        out = jverify(logits[perm], drafts[perm], num_drafts[perm], arrays_for(params, list(np.asarray(seeds)[perm])),
                      steps[perm], pm, counts, draft_probs=None if draft_probs is None else draft_probs[perm])
        return [np.asarray(x) for x in out]

    seeds = list(range(B))
    first, again = run(seeds), run(seeds)
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    other = run([s + 1000 for s in seeds])
    assert np.mean(np.any(first[1] != other[1], axis=1)) > 0.5
    perm = rng.permutation(B)
    permuted = run(seeds, perm)      # a row's outcome does not depend on its neighbours nor its place
    for x, y in zip(first, permuted):
        np.testing.assert_array_equal(x[perm], y)


def test_bad_shapes_raise(jverify):
    B, Q, V = 2, 3, 10
    z = lambda *s: np.zeros(s, np.float32)
    arrays = arrays_for([SamplingParams()] * B, [0, 1])
    args = (z(B, Q, V), np.zeros((B, Q - 1), np.int32), np.zeros(B, np.int32), arrays, np.zeros(B, np.int32),
            np.zeros((B, V), bool), np.zeros((B, V), np.int32))
    with pytest.raises(ValueError, match="drafts must have shape"):
        verify(args[0], np.zeros((B, Q), np.int32), *args[2:])
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify(*args, draft_probs=z(B, Q, V))
    with pytest.raises(ValueError, match="logits must be"):
        verify(z(B, V), *args[1:])


# --------------------------------------------------------------------------- losslessness, statistically

ALPHA = 1e-4          # each test's false-alarm rate (the inputs are fixed, so a test passes or fails for good)
DRAWS = 20_000        # independent verify rows (one seed each) per case
STAT_V = 8
STAT_LOGITS = np.array([
    [1.0, 0.2, 1.6, -0.5, 0.7, 1.3, -1.2, 0.0],
    [0.3, 1.4, -0.4, 1.0, 0.6, -1.0, 0.9, 0.1],
    [-0.2, 0.5, 1.1, 0.0, 1.5, 0.4, -0.8, 0.8],
], np.float32)
# the drafts' q: sharper than p, with some mass on every token (rejections both ways, drafts outside top-k)
DRAFT_Q = 0.8 * np.exp(1.6 * STAT_LOGITS[:2]) / np.sum(np.exp(1.6 * STAT_LOGITS[:2]), axis=-1, keepdims=True) + 0.2 / STAT_V
STAT_PROMPT = np.isin(np.arange(STAT_V), [1, 4])
STAT_COUNTS = np.array([0, 0, 2, 0, 0, 1, 0, 0], np.int32)

STAT_CASES = {
    "temperature": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=1.3, top_k=4),
    "top_p": SamplingParams(temperature=0.8, top_p=0.75),
    "min_p": SamplingParams(temperature=1.1, min_p=0.25),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.6),
}


def chi_square(observed, probs):
    """Pearson's statistic and degrees of freedom of counts `observed` against `probs`; cells expecting
    fewer than 5 are pooled (into the smallest other cell when the pool expects fewer than 5 too). A count
    where the probability is 0 gives an infinite statistic."""
    n = observed.sum()
    if n == 0:
        return 0.0, 0
    if np.any(observed[probs == 0] > 0):
        return np.inf, 0
    e = n * probs
    big = e >= 5
    obs, exp = list(observed[big].astype(float)), list(e[big])
    rest_o, rest_e = observed[~big].sum(), e[~big].sum()
    if rest_e > 0:
        if rest_e >= 5 or not obs:
            obs.append(rest_o), exp.append(rest_e)
        else:
            i = int(np.argmin(exp))
            obs[i] += rest_o
            exp[i] += rest_e
    if len(obs) < 2:
        return 0.0, 0
    obs, exp = np.array(obs), np.array(exp)
    return float(np.sum((obs - exp) ** 2 / exp)), len(obs) - 1


def chain_statistic(tokens, num_accepted, drafts, params, count_drafts=True):
    """Pooled chi-square of the emitted chains against the target: position j is tested on the rows that
    emitted it (num_accepted >= j, so tokens[:j] are the drafts), grouped by that prefix, against
    p_j(. | prefix). A pooled test of conditional tables (as for a Markov chain's transition
    probabilities, Anderson & Goodman 1957): the degrees of freedom add up. Returns (stat, df, margin),
    margin being how close a filter came to its threshold in the reference."""
    stat, df, margin = 0.0, 0, np.inf
    for j in range(STAT_LOGITS.shape[0]):
        emitted = num_accepted >= j
        for prefix in itertools.product(range(STAT_V), repeat=j):
            rows = emitted & np.all(drafts[:, :j] == np.array(prefix, np.int32), axis=1)
            if not rows.any():
                continue
            counts = STAT_COUNTS + (np.bincount(prefix, minlength=STAT_V) if count_drafts else 0)
            p, m = reference_probs(STAT_LOGITS[j], params, STAT_PROMPT, counts)
            s, d = chi_square(np.bincount(tokens[rows, j], minlength=STAT_V), p)
            stat, df, margin = stat + s, df + d, min(margin, m)
    return stat, df, margin


def run_chains(jverify, params, draft_probs_mode, seed_base):
    """DRAWS independent verify rows over STAT_LOGITS with two drafts drawn from DRAFT_Q."""
    rng = np.random.default_rng(seed_base)
    drafts = np.stack([rng.choice(STAT_V, DRAWS, p=DRAFT_Q[j]) for j in range(2)], axis=1).astype(np.int32)
    logits = np.broadcast_to(STAT_LOGITS, (DRAWS, 3, STAT_V))
    arrays = arrays_for([params] * DRAWS, list(range(seed_base, seed_base + DRAWS)))
    draft_probs = np.broadcast_to(DRAFT_Q, (DRAWS, 2, STAT_V)).astype(np.float32) if draft_probs_mode else None
    a, tokens, _ = jverify(logits, drafts, np.full(DRAWS, 2, np.int32), arrays, np.zeros(DRAWS, np.int32),
                           np.broadcast_to(STAT_PROMPT, (DRAWS, STAT_V)), np.broadcast_to(STAT_COUNTS, (DRAWS, STAT_V)),
                           draft_probs=draft_probs)
    return np.asarray(a), np.asarray(tokens), drafts


@pytest.mark.parametrize("case", list(STAT_CASES))
@pytest.mark.parametrize("draft_probs_mode", [False, True], ids=["one_hot_drafts", "draft_probs"])
def test_emitted_chains_follow_the_target_distribution(jverify, case, draft_probs_mode):
    params = STAT_CASES[case]
    a, tokens, drafts = run_chains(jverify, params, draft_probs_mode, seed_base=list(STAT_CASES).index(case) * DRAWS * 2 + draft_probs_mode * DRAWS)
    stat, df, margin = chain_statistic(tokens, a, drafts, params)
    assert margin > 1e-4, "a filter decides too close to its threshold for a float32 comparison"
    critical = chi2.ppf(1 - ALPHA, df)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (df {df}): not the target distribution"
    # the check had something to check: drafts rejected and accepted, the bonus row reached
    assert 0.05 < np.mean(a == 0) < 0.95 and np.mean(a == 2) > 0.01
    if case == "penalties":   # the statistic sees the drafts' effect on the penalties
        wrong, wrong_df, _ = chain_statistic(tokens, a, drafts, params, count_drafts=False)
        assert wrong > chi2.ppf(1 - ALPHA, wrong_df)


def test_the_statistic_rejects_wrong_acceptance_rules():
    """The same statistic on chains made by wrong rules: always accepting the draft, and resampling from
    p (instead of the residual max(p - q, 0)) after a rejection."""
    rng = np.random.default_rng(3)
    params = STAT_CASES["temperature"]
    p = reference_probs(STAT_LOGITS[0], params, STAT_PROMPT, STAT_COUNTS)[0]
    q = DRAFT_Q[0]
    d0 = rng.choice(STAT_V, DRAWS, p=q)
    drafts = np.stack([d0, np.zeros(DRAWS, int)], axis=1).astype(np.int32)
    none_accepted = np.zeros(DRAWS, np.int32)        # only position 0 is tested
    always = np.stack([d0, np.zeros(DRAWS, int), np.zeros(DRAWS, int)], axis=1)
    accept = rng.random(DRAWS) < np.minimum(1, p[d0] / q[d0])
    resampled = np.where(accept, d0, rng.choice(STAT_V, DRAWS, p=p))
    wrong_resample = np.stack([resampled, np.zeros(DRAWS, int), np.zeros(DRAWS, int)], axis=1)
    right = np.stack([rng.choice(STAT_V, DRAWS, p=p), np.zeros(DRAWS, int), np.zeros(DRAWS, int)], axis=1)
    for tokens, should_pass in [(always, False), (wrong_resample, False), (right, True)]:
        stat, df, _ = chain_statistic(tokens, none_accepted, drafts, params)
        assert (stat < chi2.ppf(1 - ALPHA, df)) == should_pass, (stat, df)
