"""Speculative decoding in the engine: n-gram and draft-model proposals verified by the target give the very
tokens decoding without speculation gives (greedy), batched and alone, with the prefix cache, chunked prefill and
preemption; seeded sampling reproduces; drafts' pages return; bad settings fail clearly."""

import json
import shutil

import numpy as np
import pytest

from conftest import DATA, SHARED, STORIES, record_steps
from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import ModelLoadError
from jaxinfer.spec.adaptive import choose_drafts, expected_tokens
from jaxinfer.spec.ngram import ngram_proposal

XS = SHARED / "models" / "llama2xs-260k"
DFLASH = DATA / "models" / "dflash-tiny"   # a random drafter for the tiny Qwen3 (tools/make_dflash_golden.py)
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
# copy-heavy prompts (n-gram proposals find matches) and open ones
PROMPTS = [
    "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom had a red",
    "Once upon a time, there was a little girl named Lily. She loved to play. One day, Lily",
    "The cat sat",
    "Lily and Tom went to the park. Lily and Tom went to the park. Lily and Tom went to",
]


@pytest.fixture(scope="module")
def plain():
    return LLM(STORIES, max_num_seqs=4, max_num_batched_tokens=64, progress=False, cache_dir="")


@pytest.fixture(scope="module")
def reference(plain):
    return [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]


def _spec(model, **settings) -> LLM:
    """An engine with speculation whose every step verifies what its proposer drafts (no adaptive choice, which
    times steps: the tests need the drafts whatever the CPU measures)."""
    llm = LLM(model, progress=False, cache_dir="", **settings)
    llm.engine.speculator.adaptive = False
    return llm


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _no_pages_held(llm):
    pages = llm.engine.pages
    assert pages.num_in_use == 0, "pages left held after every request finished"


# ---- proposals and the draft count ----

def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert ngram_proposal([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]          # 3-gram 1 2 3
    assert ngram_proposal([1, 2, 3, 9, 2, 3, 8, 2, 3], 2) == [8, 2]          # the latest 2-gram 2 3
    assert ngram_proposal([1, 2, 3, 4, 5, 9, 8, 3], 3) == []                 # only a 1-gram: below min_n
    assert ngram_proposal([1, 2, 3, 4, 5, 9, 8, 3], 3, min_n=1) == [4, 5, 9]
    assert ngram_proposal([5, 6, 5, 6], 4) == [5, 6]                         # only what follows exists
    assert ngram_proposal([7], 4) == [] and ngram_proposal([1, 2, 1, 2], 0) == []
    rng = np.random.default_rng(0)
    for _ in range(200):                                                      # against a brute-force search
        t = rng.integers(0, 4, rng.integers(2, 40)).tolist()
        want = []
        for n in range(4, 1, -1):
            hits = [i for i in range(len(t) - n) if t[i:i + n] == t[len(t) - n:]]
            if hits:
                want = t[hits[-1] + n: hits[-1] + n + 5]
                break
        assert ngram_proposal(t, 5) == want, t


def test_the_draft_count_follows_acceptance_and_batch_size():
    assert choose_drafts([0.9], [0], 4) == 0                      # nothing proposed
    assert choose_drafts([0.9], [4], 4) == 4                      # batch 1, good acceptance: all
    assert choose_drafts([0.02], [4], 4) == 0                     # drafts that fail cost more than they give
    assert choose_drafts([0.9] * 256, [4] * 256, 4) < 4           # a large batch is compute-bound: fewer
    assert choose_drafts([0.02], [4], 4, adaptive=False) == 4
    assert expected_tokens(0.5, 2) == 1.75


# ---- greedy: the same tokens with speculation on ----

@pytest.mark.parametrize("speculative", ["ngram", f"draft:{XS}"])
def test_greedy_tokens_are_unchanged_batched_and_alone(speculative, reference):
    llm = _spec(STORIES, speculative=speculative, num_speculative_tokens=4, max_num_seqs=4,
              max_num_batched_tokens=64)
    ran = record_steps(llm.engine.runner)
    assert _tokens(llm, PROMPTS) == reference
    for prompt, ref in zip(PROMPTS[:2], reference):
        assert _tokens(llm, [prompt]) == [ref]
    stats = llm.engine.speculator.stats
    assert stats.drafted > 0 and 0 < stats.accepted <= stats.drafted
    assert any(name.startswith("verify-greedy") for name in ran)
    _no_pages_held(llm)


def test_a_draft_equal_to_the_target_is_always_accepted():
    """The target as its own draft: every draft accepted, each verify emits k + 1 tokens (the bonus path)."""
    model = DATA / "models" / "qwen3"
    params = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)
    want = _tokens(LLM(model, progress=False, cache_dir="", skip_tokenizer_init=True), [[1, 2, 3, 4, 5]], params)
    llm = _spec(model, speculative=f"draft:{model}", num_speculative_tokens=3, skip_tokenizer_init=True)
    assert _tokens(llm, [[1, 2, 3, 4, 5]], params) == want
    stats = llm.engine.speculator.stats
    assert stats.accepted == stats.drafted > 0
    assert stats.mean_accepted_length == 4.0


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gpt2", "mistral_swa", "qwen2_swa", "mixtral", "qwen3_moe",
                                    "phi3", "phi4_mini", "apertus", "gemma3"])   # qwen3: the DFlash and draft tests below
def test_greedy_tokens_are_unchanged_for_every_family(family):
    """The families of the first three with n-gram and draft proposers; the others (sliding windows, experts, partial
    rotary, softcapping) with the model as its own draft, which drafts at every step: the verify path is the same."""
    model = DATA / "models" / family
    prompt = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = _tokens(LLM(model, progress=False, cache_dir="", skip_tokenizer_init=True), prompt, params)
    proposers = ("ngram", f"draft:{model}") if family in ("llama3", "qwen2", "gpt2") else (f"draft:{model}",)
    for speculative in proposers:   # a random model rarely repeats; itself as a draft always drafts
        llm = _spec(model, speculative=speculative, skip_tokenizer_init=True)
        assert _tokens(llm, prompt, params) == want
    assert llm.engine.speculator.stats.drafted > 0


def test_drafts_ride_in_ragged_steps_beside_prompt_chunks_and_the_prefix_cache(reference):
    """A small token budget: a newcomer's prompt runs in chunks while the others verify drafts in the same
    step; the repeated prompt takes cached pages."""
    llm = _spec(STORIES, speculative="ngram", max_num_seqs=4, max_num_batched_tokens=16)
    ran = record_steps(llm.engine.runner)
    assert _tokens(llm, PROMPTS + PROMPTS[:1]) == reference + reference[:1]
    assert "verify-greedy-5" in ran            # the ragged verify step (a dense one is "verify-greedy-verify-5")
    assert llm.engine.prefix_cache_hit_rate > 0
    _no_pages_held(llm)


@pytest.mark.parametrize("speculative", ["ngram", "dflash"])
def test_prompt_steps_read_back_late_beside_speculation(speculative, reference):
    """The GPU's default: prompt steps launched one ahead of their read-back (overlap_mixed, and a newcomer's prompt
    behind a decode dispatch); verify steps run between them."""
    if speculative == "ngram":
        llm = _spec(STORIES, speculative="ngram", max_num_seqs=4, max_num_batched_tokens=16, overlap_mixed=True,
                    prefill_behind_decode=True)
        assert _tokens(llm, PROMPTS) == reference
    else:
        model, params = DATA / "models" / "qwen3", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(20, 60)), [3, 4, 5]]
        want = _tokens(LLM(model, progress=False, cache_dir="", skip_tokenizer_init=True, max_num_seqs=4,
                           max_num_batched_tokens=16), prompts, params)
        llm = _spec(model, speculative=f"dflash:{DFLASH}", skip_tokenizer_init=True, max_num_seqs=4,
                    max_num_batched_tokens=16, overlap_mixed=True, prefill_behind_decode=True)
        assert _tokens(llm, prompts, params) == want
    assert llm.engine.speculator.stats.verify_steps > 0
    _no_pages_held(llm)


def test_preemption_gives_the_same_tokens(reference):
    """A pool too small for every sequence at once: sequences are preempted and recomputed (the draft model's
    own K/V as well) and still end with the same tokens."""
    for speculative in ("ngram", f"draft:{XS}"):
        llm = _spec(STORIES, speculative=speculative, max_num_seqs=4, max_num_batched_tokens=64, num_pages=20,
                  max_model_len=96, page_size=8, enable_prefix_caching=False)
        assert _tokens(llm, PROMPTS) == reference
        assert llm.engine.scheduler.num_preemptions > 0
        _no_pages_held(llm)


def test_stop_tokens_inside_accepted_drafts_end_the_text_there(plain):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want = plain.generate(PROMPTS[0], params)[0].outputs[0]
    llm = _spec(STORIES, speculative="ngram")
    got = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


# ---- sampling ----

def test_seeded_sampling_reproduces_with_speculation():
    llm = _spec(STORIES, speculative="ngram", max_num_seqs=4)
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    outs = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]] * 3, params)]
    assert outs[0] == outs[1] != outs[2]
    again = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]], params[:1])]
    assert again[0] == outs[0]
    assert llm.engine.speculator.stats.drafted > 0


def test_logprobs_of_accepted_drafts_are_the_targets(plain):
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True)
    want = plain.generate(PROMPTS[0], params)[0].outputs[0]
    llm = _spec(STORIES, speculative="ngram")
    got = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    assert [[i for i, _ in t] for t in got.top_logprobs] == [[i for i, _ in t] for t in want.top_logprobs]


# ---- bad input ----

@pytest.mark.parametrize("settings, message", [
    (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative="ngram", num_speculative_tokens=16), "num_speculative_tokens"),
    (dict(speculative="eagle"), "speculative must be"),
    (dict(num_speculative_tokens=3), "needs speculative"),
    (dict(speculative="draft:"), "draft model's folder"),
])
def test_bad_speculative_settings_fail_clearly(settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(STORIES, progress=False, cache_dir="", **settings)


def test_a_draft_model_of_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="vocabulary"):
        LLM(STORIES, speculative=f"draft:{DATA / 'models' / 'qwen3'}", progress=False, cache_dir="")
    other = tmp_path / "xs"
    shutil.copytree(XS, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["en"], vocab["an"] = vocab["an"], vocab["en"]          # two ids swapped: same size, other text
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="different tokenizer"):
        LLM(STORIES, speculative=f"draft:{other}", progress=False, cache_dir="")
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(STORIES, speculative=f"draft:{tmp_path / 'missing'}", progress=False, cache_dir="")


# ---- DFlash ----



def test_dflash_drafts_equal_the_drafter_forward_and_keep_greedy_tokens():
    """In the engine the drafter's context comes from the target's own steps (captured layer states written into
    its paged pool); its drafts equal the reference forward on the target's states of the whole sequence."""
    import jax.numpy as jnp
    from jaxinfer.ops import get_ops
    from jaxinfer.spec import dflash

    target = DATA / "models" / "qwen3"
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = _tokens(LLM(target, progress=False, cache_dir="", skip_tokenizer_init=True), prompt, params)
    llm = _spec(target, speculative=f"dflash:{DFLASH}", skip_tokenizer_init=True)
    proposer = llm.engine.speculator.proposer
    seen, propose = [], proposer.propose
    proposer.propose = lambda seqs, k: seen.append((list(seqs[0].tokens), propose(seqs, k)[0])) or [seen[-1][1]]
    assert _tokens(llm, prompt, params) == want
    assert llm.engine.config.num_speculative_tokens == proposer.dcfg.block_size - 1
    ops, e = get_ops("reference"), llm.engine
    embed, head = dflash.target_embedding_and_head(e.cfg, e.runner.params)
    for tokens, drafts in seen[::5]:
        states = dflash.target_layer_states(e.cfg, ops, e.runner.params, np.array(tokens[:-1]),
                                            proposer.dcfg.target_layer_ids)
        logits = dflash.draft_logits_from_states(proposer.dcfg, ops, proposer.params, states, tokens[-1], embed, head)
        assert drafts == np.asarray(jnp.argmax(logits, -1)).tolist()[:len(drafts)]
    # every decode step verifies (but the last, whose one token leaves no room for a draft)
    assert e.speculator.stats.verify_steps >= len(seen) - 1 > 0


def test_a_dflash_drafter_for_another_target_is_refused():
    with pytest.raises(ModelLoadError, match="does not fit the target"):
        LLM(STORIES, speculative=f"dflash:{DFLASH}", progress=False, cache_dir="")


class _Seq:
    """A generating sequence as the Speculator sees it (its tokens repeat: n-gram proposals exist)."""

    def __init__(self, request_id: int = 0):
        self.request_id, self.tokens = request_id, [1, 2, 3, 1, 2, 3, 1, 2]


def test_measured_rates_turn_verifying_off_where_it_was_slower():
    from jaxinfer.engine.speculation import PROBE_EVERY, Speculator
    from jaxinfer.spec.ngram import NgramProposer

    spec = Speculator(NgramProposer(), 4)
    assert spec.drafts([_Seq()], bucket=1)                       # batch 1, nothing measured: the cost model says draft
    spec.tried(1, drafted=True)
    spec.measured("verify", 1, 50, 1.0)
    assert not spec.may_draft([_Seq()], 1)                       # a decode dispatch next, to compare with
    spec.measured("decode", 1, 100, 1.0)                         # verifying gave half the tokens a second
    assert not spec.may_draft([_Seq()], 1) and spec.drafts([_Seq()], bucket=1) == {}
    assert spec.may_draft([_Seq()], 2)                           # another batch size is measured apart
    for _ in range(PROBE_EVERY - 2):
        spec.measured("decode", 1, 100, 1.0)
    assert not spec.may_draft([_Seq()], 1)
    spec.measured("decode", 1, 100, 1.0)
    assert spec.may_draft([_Seq()], 1)                           # tried again after PROBE_EVERY dispatches
    for _ in range(3):
        spec.tried(1, drafted=True)
        spec.measured("verify", 1, 300, 1.0)                     # and kept where it now pays
        assert spec.may_draft([_Seq()], 1)


def test_at_a_large_batch_verifying_starts_only_from_a_measured_gain():
    """Batch 64 at k = 4 (320 rows: past the cost model's knee): decode dispatches first, then one probe; a probe
    without drafts waits PROBE_EVERY dispatches; a verify step slower than decoding stops drafts, a faster one keeps
    them."""
    from jaxinfer.engine.speculation import PROBE_EVERY, Speculator
    from jaxinfer.spec.adaptive import rows_nearly_free
    from jaxinfer.spec.ngram import NgramProposer

    seqs = [_Seq(i) for i in range(64)]
    assert not rows_nearly_free(64 * 5) and rows_nearly_free(8 * 5)
    spec = Speculator(NgramProposer(), 4)
    assert not spec.may_draft(seqs, 64) and spec.drafts(seqs, bucket=64) == {}    # nothing measured: decode first
    assert spec.may_draft(seqs[:8], 8)                           # a small batch is optimistic
    spec.measured("decode", 64, 64 * 8, 0.02)
    assert spec.may_draft(seqs, 64)                              # the probe
    spec.tried(64, drafted=False)                                # found nothing to verify
    for _ in range(PROBE_EVERY):
        assert not spec.may_draft(seqs, 64)
        spec.measured("decode", 64, 64 * 8, 0.02)
    assert spec.may_draft(seqs, 64)                              # the next probe
    spec.tried(64, drafted=True)
    spec.measured("verify", 64, 64 * 2, 0.01)                    # 12.8k tokens a second against decoding's 25.6k
    assert not spec.may_draft(seqs, 64)
    slow = Speculator(NgramProposer(), 4)
    slow.measured("decode", 64, 64 * 8, 0.02)
    slow.tried(64, drafted=True)
    slow.measured("verify", 64, 64 * 3, 0.005)                   # 38.4k: faster, so drafts go on
    assert slow.may_draft(seqs, 64) and len(slow.drafts(seqs, bucket=64)) == 64


def test_a_large_batch_probe_without_proposals_keeps_the_decode_chain():
    """Before a decode dispatch is chained at a large batch (its probe due), an n-gram speculator looks at the host's
    tokens: no proposal means no verify step (the chain goes on), and the probe counts as one without drafts (the
    next waits PROBE_EVERY dispatches); a small batch stops the chain on may_draft alone."""
    from jaxinfer.engine.speculation import PROBE_EVERY, Speculator
    from jaxinfer.spec.ngram import NgramProposer

    fresh = [_Seq(i) for i in range(64)]
    for seq in fresh:
        seq.tokens = [5, 6, 7, 8, 9, 10, 11, 12]                 # no repeat: nothing to propose
    spec = Speculator(NgramProposer(), 4)
    spec.measured("decode", 64, 64 * 8, 0.02)
    assert spec.may_draft(fresh, 64) and not spec.would_draft(fresh, 64)
    for _ in range(PROBE_EVERY):
        assert not spec.may_draft(fresh, 64)
        spec.measured("decode", 64, 64 * 8, 0.02)
    assert spec.would_draft([_Seq(i) for i in range(64)], 64)   # repeats: the chain stops for the probe
    assert spec.would_draft(fresh[:1], 1)                        # batch 1: may_draft decides


def test_tries_without_drafts_back_off_where_verify_rows_are_free():
    """Batch 1: a try that finds nothing waits 1, 2, 4 ... decode dispatches (up to PROBE_EVERY) before the next; a
    try with drafts resets the wait."""
    from jaxinfer.engine.speculation import PROBE_EVERY, Speculator
    from jaxinfer.spec.ngram import NgramProposer

    spec = Speculator(NgramProposer(), 4)
    waits = []
    for _ in range(8):
        assert spec.may_draft([_Seq()], 1)
        spec.tried(1, drafted=False)
        n = 0
        while not spec.may_draft([_Seq()], 1):
            spec.measured("decode", 1, 8, 0.02)
            n += 1
        waits.append(n)
    assert waits == [1, 2, 4, 8, 16, 32, 32, 32] and PROBE_EVERY == 32
    spec.tried(1, drafted=True)
    assert spec.may_draft([_Seq()], 1)
    spec.tried(1, drafted=False)
    assert not spec.may_draft([_Seq()], 1)                       # the wait starts again from one dispatch
    spec.measured("decode", 1, 8, 0.02)
    assert spec.may_draft([_Seq()], 1)


def _steps_seen(llm) -> list[tuple[str, int, int]]:
    """(kind, generating sequences, tokens) of each step carrying prompt chunks or drafts the engine runs from now
    on: kind "ragged" (a verify step beside prompt chunks), "dense" (a verify step alone) or "mixed" (no drafts)."""
    e, seen = llm.engine, []
    verify, launch = e._launch_verify, e._launch_mixed

    def count(kind, chunks, drafts):
        seen.append((kind, sum(not s.prefilling for s, _ in chunks), sum(n for _, n in chunks) + sum(
            map(len, drafts.values()))))
    e._launch_verify = lambda chunks, drafts, dense, assumed=None: (
        count("dense" if dense else "ragged", chunks, drafts), verify(chunks, drafts, dense, assumed))[1]
    e._launch_mixed = lambda chunks: (count("mixed", chunks, {}), launch(chunks))[1]
    return seen


BATCH_PROMPTS = [p + suffix for suffix in ("", " Tom was happy.", " The sun was hot.", " Lily smiled.")
                 for p in PROMPTS]   # 16 prompts, copy-heavy and open


@pytest.fixture(scope="module")
def batch_reference():
    llm = LLM(STORIES, max_num_seqs=16, max_num_batched_tokens=32, progress=False, cache_dir="")
    return _tokens(llm, BATCH_PROMPTS)


def test_no_drafts_beside_prompt_chunks_at_a_large_batch(batch_reference):
    """A small token budget: prompts run in chunks beside the generating sequences' decodes. Drafts ride beside
    them only while at most RAGGED_DRAFTS_MAX_BATCH sequences generate; the tokens stay those of decoding."""
    from jaxinfer.engine.verify_steps import RAGGED_DRAFTS_MAX_BATCH

    llm = _spec(STORIES, speculative="ngram", max_num_seqs=16, max_num_batched_tokens=32)
    seen = _steps_seen(llm)
    assert _tokens(llm, BATCH_PROMPTS) == batch_reference
    # steps beside prompt chunks with room for drafts and more than the threshold generating did happen ...
    assert any(kind == "mixed" and n > RAGGED_DRAFTS_MAX_BATCH and tokens < 32 for kind, n, tokens in seen)
    # ... and carried no drafts
    assert all(n <= RAGGED_DRAFTS_MAX_BATCH for kind, n, _ in seen if kind == "ragged")
    assert any(kind == "dense" and n > RAGGED_DRAFTS_MAX_BATCH for kind, n, _ in seen)   # the batch verifies alone
    _no_pages_held(llm)


def test_no_drafts_that_would_break_the_prompt_steps_chain():
    """Prompt steps launched one ahead of their read-back (overlap_mixed): a step carrying a prompt chunk verifies
    drafts only where no prompt work follows it."""
    llm = _spec(STORIES, speculative="ngram", max_num_seqs=4, max_num_batched_tokens=16, overlap_mixed=True)
    e = llm.engine
    seen, verify = [], e._launch_verify
    e._launch_verify = lambda chunks, drafts, dense, assumed=None: (seen.append((dense, any(
        s.prefilling and s.num_computed + n < len(s.tokens) for s, n in chunks) or bool(e.scheduler.waiting))),
        verify(chunks, drafts, dense, assumed))[1]
    llm.generate(PROMPTS, GREEDY)
    assert seen and not any(follows for _, follows in seen)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_of_16_with_adaptive_speculation_keeps_greedy_tokens(overlap, batch_reference):
    """Adaptive speculation as served (measured rates, tries paced; with the GPU's overlap of prompt steps too):
    16 concurrent requests give the tokens decoding without speculation gives."""
    llm = LLM(STORIES, speculative="ngram", max_num_seqs=16, max_num_batched_tokens=32, progress=False,
              cache_dir="", overlap_mixed=overlap, prefill_behind_decode=overlap)
    assert _tokens(llm, BATCH_PROMPTS) == batch_reference
    assert llm.engine.speculator.stats.verify_steps > 0
    _no_pages_held(llm)


class _Replay:
    """A proposer of the host's tokens that drafts a known continuation (every draft right): the bench's oracle."""

    name, host_only = "replay", True

    def __init__(self, outputs: list[int]):
        self.outputs = outputs

    def propose(self, seqs, k: int) -> list[list[int]]:
        return [self.outputs[len(s.output_ids): len(s.output_ids) + k] for s in seqs]


def test_chained_verify_steps_keep_the_tokens_and_drop_what_failed(reference):
    """Verify steps launched before their predecessor is read back (Tuning.chain_verify): the n-gram's greedy tokens
    equal plain decoding's and the unchained steps', steps were chained, and rows whose guess failed were dropped;
    a proposer that is always right has every chained row kept."""
    chained = _spec(STORIES, speculative="ngram", num_speculative_tokens=4, chain_verify=True)
    assert _tokens(chained, PROMPTS[:1]) == reference[:1]
    stats = chained.engine.speculator.stats
    assert stats.chained_steps > 0 and stats.chained_rows_dropped > 0
    unchained = _spec(STORIES, speculative="ngram", num_speculative_tokens=4, chain_verify=False)
    assert _tokens(unchained, PROMPTS[:1]) == reference[:1]
    assert unchained.engine.speculator.stats.chained_steps == 0
    _no_pages_held(chained)

    exact = _spec(STORIES, speculative="ngram", num_speculative_tokens=4, chain_verify=True)
    exact.engine.speculator.proposer = _Replay(reference[0])
    assert _tokens(exact, PROMPTS[:1]) == reference[:1]
    stats = exact.engine.speculator.stats
    assert stats.chained_steps > 0 and stats.chained_rows_dropped == 0
    assert stats.accepted == stats.drafted
    _no_pages_held(exact)


def test_chained_verify_steps_keep_a_seeds_text():
    """Sampled requests with a seed (no penalties: those are never chained) give the same text chained or not."""
    params = SamplingParams(max_tokens=60, temperature=0.5, top_p=0.9, seed=7, ignore_eos=True)
    texts = []
    for chain in (True, False):
        llm = _spec(STORIES, speculative="ngram", num_speculative_tokens=4, chain_verify=chain)
        texts.append(_tokens(llm, PROMPTS[:1], params))
        assert (llm.engine.speculator.stats.chained_steps > 0) == chain
    assert texts[0] == texts[1]


def test_a_chained_step_keeps_the_pages_its_drafts_are_written_to(reference):
    """More drafts than the decode steps a trim keeps pages for, on small pages: the step launched behind the one
    read back writes its drafts' K/V into pages held for it, which that read-back must not return (they were, and
    the accepted drafts' K/V were lost: other tokens from there on)."""
    llm = _spec(STORIES, speculative="ngram", num_speculative_tokens=8, chain_verify=True, page_size=4,
                decode_steps=1)
    llm.engine.speculator.proposer = _Replay(reference[1])
    assert _tokens(llm, PROMPTS[1:2]) == reference[1:2]
    stats = llm.engine.speculator.stats
    assert stats.chained_steps > 0 and stats.accepted == stats.drafted
    _no_pages_held(llm)


class _Oracle:
    """_Replay for several prompts: each sequence drafts its own known continuation."""

    name, host_only = "oracle", True

    def __init__(self, prompts: list[str], outputs: list[list[int]], tokenizer):
        self.outputs = {tuple(tokenizer.encode(p)): out for p, out in zip(prompts, outputs)}

    def propose(self, seqs, k: int) -> list[list[int]]:
        return [self.outputs[tuple(s.prompt_ids)][len(s.output_ids): len(s.output_ids) + k] for s in seqs]


@pytest.mark.parametrize("finished", [False, True])
def test_an_abort_while_a_chained_verify_step_is_in_flight(finished, reference):
    """A request aborted while a verify step chained behind its last read-back is in flight: generating, or just
    finished by a stop token (it stays in the batch until the chain ends; its later settle registered its freed
    pages: IndexError). The other request's tokens are unchanged and no page stays held."""
    llm = _spec(STORIES, speculative="ngram", num_speculative_tokens=4, max_num_seqs=4)
    e = llm.engine
    e.speculator.proposer = _Oracle(PROMPTS[:2], reference[:2], e.tokenizer)
    stop = next(t for i, t in enumerate(reference[0]) if i >= 24 and t not in reference[0][:i])   # past a block
    a = e.add_request(PROMPTS[0], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=[stop] if finished else None))
    b = e.add_request(PROMPTS[1], GREEDY)
    aborted = False
    while e.has_unfinished():
        e.step()
        f = e._inflight_verify
        rows = {s.request_id: s for s, _ in f.chunks} if f is not None and f.assumed else {}
        if not aborted and a in rows and (rows[a].finish_reason is not None) == finished:
            e.abort(a)
            aborted = True
    assert aborted and e.take_finished(b).outputs[0].token_ids == reference[1]
    assert a not in e._finished and e.speculator.stats.chained_steps > 0
    _no_pages_held(llm)


def test_an_aborted_request_leaves_no_speculation_state():
    """An abort between steps: the speculator's acceptance and chaining estimates and the draft model's record of
    the request are dropped with it (they were kept for good: a server's memory grew with each abort)."""
    llm = _spec(STORIES, speculative=f"draft:{XS}", max_num_seqs=4)
    e = llm.engine
    a = e.add_request(PROMPTS[0], GREEDY)
    b = e.add_request(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while a not in e.speculator.proposer._state or e._inflight_verify is not None:   # nothing in flight
        e.step()
    e.abort(a)
    while e.has_unfinished():
        e.step()
    e.take_finished(b)
    assert not e.speculator._acceptance and not e.speculator._chains and not e.speculator.proposer._state
    _no_pages_held(llm)


def test_chained_verify_steps_are_timed_from_the_last_read_back(reference):
    """The measured verify rate (which decides against decode dispatches whether to draft) counts a chained step's
    time from its predecessor's read-back, as a chained decode dispatch's is: the host's time between steps (here a
    slow caller, 50 ms) included. It was timed from the successor's launch, just before its read-back, which left the
    caller's time out (rates several times too high)."""
    import time

    llm = _spec(STORIES, speculative="ngram", num_speculative_tokens=4)
    e = llm.engine
    e.speculator.proposer = _Replay(reference[0])
    e.add_request(PROMPTS[0], GREEDY)
    while e.has_unfinished():
        e.step()
        time.sleep(0.05)
    assert e.speculator.stats.chained_steps > 3
    assert e.speculator._rates["verify", 1] < 2 * 5 / 0.05   # at most 5 tokens a step, a step >= 50 ms


def test_prompt_logprobs_of_a_prompt_chunked_beside_drafts():
    """A prompt asking for prompt logprobs, in chunks while another sequence drafts: the steps carrying its chunks
    score every prompt token (a verify step beside them scored none: 15 of 26 came back); its tokens and the other's
    are unchanged."""
    settings = dict(max_num_seqs=4, max_num_batched_tokens=16, enable_prompt_logprobs=True)
    params = [GREEDY, SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=2, ignore_eos=True)]
    want = LLM(STORIES, progress=False, cache_dir="", **settings).generate(PROMPTS[:2], params)
    llm = _spec(STORIES, speculative="ngram", **settings)
    got = llm.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(got[1].prompt_logprobs) == len(want[1].prompt_logprobs) == len(got[1].prompt_token_ids)
    for a, b in zip(got[1].prompt_logprobs[1:], want[1].prompt_logprobs[1:]):
        assert a[0] == pytest.approx(b[0], abs=1e-5) and [i for i, _ in a[1]] == [i for i, _ in b[1]]
    assert llm.engine.speculator.stats.drafted > 0
    _no_pages_held(llm)


@pytest.mark.parametrize("ending", ["stop string", "stop token id", "max_tokens"])
def test_an_end_in_the_middle_of_a_chained_accepted_run(ending, reference):
    """Every draft right (each step chained behind the one before): a stop string, a stop token id or max_tokens
    reached in the middle of an accepted run ends the text where plain decoding ends it, beside a request that goes on;
    the rows chained behind the end are dropped."""
    out = reference[0]
    end = next(i for i, t in enumerate(out) if i >= 17 and t not in out[:i])   # a token first seen there
    llm = _spec(STORIES, speculative="ngram", num_speculative_tokens=4, max_num_seqs=4)
    e = llm.engine
    e.speculator.proposer = _Oracle(PROMPTS[:2], reference[:2], e.tokenizer)
    params = {"stop string": SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                            stop=[e.tokenizer.decode(out[:end + 1])[-4:]]),
              "stop token id": SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop_token_ids=[out[end]]),
              "max_tokens": SamplingParams(max_tokens=end + 1, temperature=0.0, ignore_eos=True)}[ending]
    want = LLM(STORIES, progress=False, cache_dir="").generate(PROMPTS[0], params)[0].outputs[0]
    got, other = llm.generate(PROMPTS[:2], [params, GREEDY])
    got = got.outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert other.outputs[0].token_ids == reference[1]
    assert e.speculator.stats.chained_steps > 0
    _no_pages_held(llm)


@pytest.mark.parametrize("speculative", ["ngram", f"draft:{XS}"])
def test_penalties_and_n_samples_give_the_tokens_of_decoding(speculative, plain):
    """Penalties (greedy and sampled: the verify rows count the drafts before them) and a request of n = 2 seeded
    samples, batched under the GPU's overlap of prompt steps: every completion is token for token what decoding gives
    (a seeded draw is coupled to plain sampling's)."""
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.4),
              SamplingParams(max_tokens=32, temperature=0.8, top_k=20, seed=3, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(max_tokens=24, temperature=1.0, seed=11, n=2, ignore_eos=True),
              GREEDY]
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(PROMPTS, params)]
    llm = _spec(STORIES, speculative=speculative, max_num_seqs=4, max_num_batched_tokens=64, overlap_mixed=True,
                prefill_behind_decode=True)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)] == want
    assert llm.engine.speculator.stats.accepted > 0
    _no_pages_held(llm)


@pytest.mark.parametrize("speculative", ["draft", "dflash"])
def test_model_proposers_under_preemption_and_prefix_cache_hits(speculative):
    """A draft model and a DFlash drafter (their own pools, indexed by the target's page tables) in a pool small enough
    to preempt, prompts in chunks, then prompts whose blocks are cached (a repeated prompt, one that goes on from an
    earlier output): the greedy tokens of decoding, no page left held."""
    model = DATA / "models" / "qwen3"
    settings = dict(skip_tokenizer_init=True, max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=24,
                    max_model_len=64)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(20, 60)), [3, 4, 5], list(range(60, 90))]
    plain = LLM(model, progress=False, cache_dir="", **settings)
    want = _tokens(plain, prompts, params)
    later = [list(range(20, 60)), list(range(20, 60)) + want[1][:8]]
    want_later = _tokens(plain, later, params)
    llm = _spec(model, speculative=f"draft:{model}" if speculative == "draft" else f"dflash:{DFLASH}", **settings)
    assert _tokens(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(llm, later, params) == want_later
    assert llm.engine.prefix_cache_hit_rate > 0 and llm.engine.speculator.stats.accepted > 0
    _no_pages_held(llm)
