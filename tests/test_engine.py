"""End to end on the reference path: goldens from transformers, batching invariance, seeds, no recompiles."""

import json

import jax
import numpy as np
import pytest

from conftest import DATA, STORIES, no_compiles, record_steps
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.llm import stream
from jaxinfer.runner.model_runner import bucket_of
from jaxinfer.runner.split_step import SplitStep
from jaxinfer.runner.variants import StepVariant

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stories():
    # Small budgets so that several prompts need several mixed steps and decode buckets.
    return LLM(STORIES, max_num_seqs=4, max_num_batched_tokens=64, progress=False, compile_all_at_start=True)


def test_stories_greedy_200_tokens_match_transformers(stories):
    golden = json.loads((DATA / "golden" / "stories260k.json").read_text())
    out = stories.generate(golden["prompt"], SamplingParams(max_tokens=200, temperature=0))[0]
    assert out.prompt_token_ids == golden["prompt_ids"]
    assert out.outputs[0].token_ids == golden["greedy_ids"]
    assert out.outputs[0].text == golden["greedy_text"]
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("family", ["llama2", "llama3", "mistral", "qwen2", "qwen3", "gpt2", "qwen3_moe", "mixtral"])
def test_family_greedy_tokens_match_transformers(family):
    golden = np.load(DATA / "golden" / f"{family}.npz")
    llm = LLM(DATA / "models" / family, max_num_seqs=4, max_num_batched_tokens=32, decode_steps=4,
              skip_tokenizer_init=True, progress=False)
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    outs = llm.generate(prompts, GREEDY)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist(), f"{family} prompt {i}"


PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park to play with a big red ball. They ran and ran until",
    "One day",
    "Tim had a toy car. He liked to push it across the floor, and his sister watched him. She said",
    "Sue",
]


def test_batch_equals_alone_greedy(stories):
    params = SamplingParams(max_tokens=40, temperature=0)
    together = stories.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together):
        alone = stories.generate(prompt, params)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, prompt
        assert out.outputs[0].text == alone.outputs[0].text


def test_seeded_sampling_is_reproducible_whatever_the_batch(stories):
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=1234)
    alone = stories.generate(PROMPTS[0], params)[0]
    again = stories.generate(PROMPTS[0], params)[0]
    assert alone.outputs[0].token_ids == again.outputs[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=0.7, seed=s) for s in range(len(PROMPTS) - 1)]
    batch = stories.generate(PROMPTS[1:] + PROMPTS[:1], others + [params])
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = stories.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=1.0, seed=99))[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_stop_strings_and_stop_tokens(stories):
    full = stories.generate(PROMPTS[0], SamplingParams(max_tokens=60, temperature=0))[0]
    assert "Lily" in full.outputs[0].text
    cut = stories.generate(PROMPTS[0], SamplingParams(max_tokens=60, temperature=0, stop=["Lily"]))[0]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].text == full.outputs[0].text[: full.outputs[0].text.index("Lily")]
    third = full.outputs[0].token_ids[2]
    by_id = stories.generate(PROMPTS[0], SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[third]))[0]
    assert by_id.outputs[0].finish_reason == "stop" and by_id.outputs[0].token_ids == full.outputs[0].token_ids[:3]


def test_streamed_text_equals_final_text(stories):
    params = SamplingParams(max_tokens=50, temperature=0)
    pieces = [d.text for d in stream(stories.engine, PROMPTS[2], params)]
    assert "".join(pieces) == stories.generate(PROMPTS[2], params)[0].outputs[0].text
    assert len(pieces) > 1


def test_no_compilation_after_warmup(stories):
    with no_compiles():
        rng = np.random.default_rng(0)
        for batch_size in (1, 3, 4, 6):
            prompts = [PROMPTS[i % len(PROMPTS)] * int(rng.integers(1, 4)) for i in range(batch_size)]
            params = [SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=float(rng.choice([0, 0.8])),
                                     top_k=int(rng.choice([-1, 5])), repetition_penalty=1.1, seed=i)
                      for i in range(batch_size)]
            stories.generate(prompts, params)


def test_short_dispatches_for_small_batches_give_the_same_tokens(stories):
    """Batches of up to 2 sequences decode 2 steps per dispatch, larger ones 8: as the batch of 4
    shrinks (different lengths) it crosses over; greedy and seeded tokens are those of 8 steps
    throughout, and nothing compiles after start-up."""
    short = LLM(STORIES, compile_all_at_start=True, max_num_seqs=4, max_num_batched_tokens=64, short_decode_max_batch=2, short_decode_steps=2,
                progress=False)
    r = short.engine.runner
    assert [r.decode_steps_for(b) for b in r.batch_buckets] == [2, 2, 8]
    params = [SamplingParams(max_tokens=n, temperature=t, seed=7, ignore_eos=True)
              for n, t in zip((5, 17, 33, 50), (0, 0.8, 0, 1.0))]
    with no_compiles():
        got = [o.outputs[0].token_ids for o in short.generate(PROMPTS[:4], params)]
    assert got == [o.outputs[0].token_ids for o in stories.generate(PROMPTS[:4], params)]
    assert [len(t) for t in got] == [5, 17, 33, 50]


def test_gpu_defaults_read_prompt_steps_back_late_with_the_greedy_only_step():
    """On GPUs these are on by default (each measured there); on CPUs off; an explicit value stays."""
    from jaxinfer.settings import EngineConfig

    names = ("overlap_mixed", "greedy_mixed_step", "prefill_behind_decode", "fresh_prompt_attention",
             "prefixed_chunk_attention", "plain_sampling_step", "executable_cache")
    gpu, cpu = EngineConfig().resolved("gpu", False).tuning, EngineConfig().resolved("cpu", False).tuning
    assert all(getattr(gpu, n) is True for n in names)
    assert all(getattr(cpu, n) is False for n in names)
    resolved = lambda **kw: EngineConfig.from_options(**kw).resolved("gpu", False).tuning
    assert resolved(overlap_mixed=False).overlap_mixed is False
    assert resolved(prefixed_chunk_attention=False).prefixed_chunk_attention is False
    # the one-prompt step split after 6 layers on GPUs, one executable on CPUs; an explicit 0 stays
    assert (gpu.prompt_step_head_layers, cpu.prompt_step_head_layers) == (6, 0)
    assert resolved(prompt_step_head_layers=0).prompt_step_head_layers == 0


def test_settings_are_checked_by_name():
    """An engine setting is an EngineConfig or Tuning field; any other name is an error that names it."""
    from jaxinfer.settings import EngineConfig

    assert EngineConfig.from_options(max_num_seqs=3, overlap_mixed=False).tuning.overlap_mixed is False
    with pytest.raises(ValueError, match="unknown engine setting: max_num_seq$"):
        EngineConfig.from_options(max_num_seq=3)
    with pytest.raises(ValueError, match="unknown engine settings: bogus, frobnicate"):
        LLM(STORIES, frobnicate=1, bogus=2)


def test_greedy_mixed_steps_give_the_same_tokens(stories):
    """With greedy_mixed_step (the GPU default) all-greedy prompt steps run the greedy-only mixed step;
    a step with a sampled row or a row wanting logprobs runs the sampling one. Greedy, seeded and
    logprob outputs equal the engine's without it, and nothing compiles after start-up."""
    llm = LLM(STORIES, compile_all_at_start=True, max_num_seqs=4, max_num_batched_tokens=64, greedy_mixed_step=True, progress=False)
    ran = record_steps(llm.engine.runner)
    cases = [
        [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 3,
        [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)],
        [SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)],
    ]
    with no_compiles():
        got = []
        for params in cases:
            ran.clear()
            got.append(llm.generate(PROMPTS[:len(params)], params))
            mixed = {n for n in ran if n.startswith("mixed")}
            assert mixed == ({"mixed-greedy"} if params is cases[0] else {"mixed"})
    for params, outs in zip(cases, got):
        want = stories.generate(PROMPTS[:len(params)], params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        np.testing.assert_allclose([lp for o in outs for lp in o.outputs[0].logprobs], [lp for o in want for lp in o.outputs[0].logprobs],
                                   rtol=1e-5, atol=1e-5)
    tops, want_tops = got[2][0].outputs[0].top_logprobs, stories.generate(PROMPTS[:1], cases[2])[0].outputs[0].top_logprobs
    assert len(tops) == 6 and [[i for i, _ in t] for t in tops] == [[i for i, _ in t] for t in want_tops]
    np.testing.assert_allclose([v for t in tops for _, v in t], [v for t in want_tops for _, v in t], atol=1e-5)


def test_sampling_steps_without_the_sort_give_the_same_tokens(stories):
    """plain_sampling_step: a sampling step (mixed or decode) runs the variant sampling.sampler_for gives
    its rows: "-plain" (no row with top-k or top-p), "-filter" (top-k of at most 64, with or without
    top-p), "-filter-p" (rows with top-p alone too; it sorts instead when the step samples at most
    SORT_MAX_ROWS rows), else the sorting one (a top-k above 64); none has a device-side branch. A plain
    decode dispatch where no row wants top logprobs runs "-plain-notop" (no top-k over the vocabulary).
    Greedy rows wanting logprobs, seeded sampled rows and batches of both give the tokens, logprobs and
    top logprobs of the engine without it; nothing compiles after start-up."""
    llm = LLM(STORIES, compile_all_at_start=True, plain_sampling_step=True, max_num_seqs=4, max_num_batched_tokens=64, greedy_mixed_step=True,
              progress=False)
    ran = record_steps(llm.engine.runner)
    plain = SamplingParams(max_tokens=12, temperature=1.1, min_p=0.05, presence_penalty=0.5, seed=4, ignore_eos=True)
    top_k = SamplingParams(max_tokens=12, temperature=0.6, top_k=20, top_p=0.95, seed=7, ignore_eos=True, logprobs=2)
    cases = [  # (params per prompt, the sampling variants they run)
        ([SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)] * 2, {"-plain"}),
        ([plain, SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.2, seed=5, ignore_eos=True)],
         {"-plain", "-plain-notop"}),   # the prompt steps, then decode
        ([top_k, plain], {"-filter"}),   # the filter at every row count, decode's 2 rows too
        ([SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=6, ignore_eos=True)] * 3, {"-filter"}),
        ([SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=2), top_k],
         {"-filter-p", ""}),   # top-p alone: the radix search; decode's 2 rows (SORT_MAX_ROWS) sort
        ([SamplingParams(max_tokens=12, temperature=0.8, top_p=0.8, seed=9, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=12, temperature=0.9, top_k=100, seed=8, ignore_eos=True)], {""}),
        ([SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.9, top_k=100, seed=6, ignore_eos=True)], {""}),
    ]
    got = []
    with no_compiles():
        for params, variant in cases:
            ran.clear()
            got.append(llm.generate(PROMPTS[:len(params)], params))
            sampling = {n.removeprefix("mixed").removeprefix("decode").rsplit("-", 1)[0] if n.startswith("decode")
                        else n.removeprefix("mixed") for n in ran} - {"-greedy"}
            assert sampling == variant, ran
    for (params, _), outs in zip(cases, got):
        want = stories.generate(PROMPTS[:len(params)], params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        np.testing.assert_allclose([lp for o in outs for lp in o.outputs[0].logprobs], [lp for o in want for lp in o.outputs[0].logprobs],
                                   rtol=1e-5, atol=1e-5)
        for o, w in zip(outs, want):
            assert [[i for i, _ in t] for t in o.outputs[0].top_logprobs or []] == [[i for i, _ in t] for t in w.outputs[0].top_logprobs or []]


@pytest.mark.parametrize("ops", ["reference", "pallas-interpret"])
def test_fresh_prompt_attention_gives_the_same_tokens(stories, ops):
    """fresh_prompt_attention: a step that is one prompt from position 0 runs its attention on its own rows
    (mixed-greedy-fresh; mixed-fresh when it samples); a step with two prompts, a prompt after a cached
    prefix or a decode row runs the paged one. Greedy and seeded sampled tokens and logprobs equal the
    engine's without it (float32), and nothing compiles after start-up."""
    system = "once upon a time there was a little girl named lily. " * 3
    prompts = [system + "she", system + "he went", "one day", "the dog ran to the park and"]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(STORIES, compile_all_at_start=True, ops=ops, max_num_seqs=4, max_num_batched_tokens=64, greedy_mixed_step=True,
              fresh_prompt_attention=True, fresh_prompt_min_tokens=16, progress=False)
    # compiled at start too: its warm-up leaves the host-to-device copies of every bucket traced (interpret mode's
    # many kernels can push them out of jit's cache before the engine under test runs)
    want = LLM(STORIES, ops=ops, max_num_seqs=4, max_num_batched_tokens=64, greedy_mixed_step=True, progress=False,
               compile_all_at_start=True)
    ran = record_steps(llm.engine.runner)
    sampled = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)
    with no_compiles():
        got = [llm.generate([p], params)[0] for p in prompts] + llm.generate(prompts, params)
        got_sampled = [llm.generate([p], sampled)[0] for p in prompts]
    # alone: the first prompt and the two without a cached prefix are fresh; the second hits the cache
    assert ran.count("mixed-greedy-fresh") == 3 and "mixed-greedy" in ran
    assert ran.count("mixed-fresh") == 2   # the short prompts: the long ones hit the cache by now
    expected = [want.generate([p], params)[0] for p in prompts] + want.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    want_sampled = [want.generate([p], sampled)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in got_sampled] == [o.outputs[0].token_ids for o in want_sampled]
    np.testing.assert_allclose([lp for o in got_sampled for lp in o.outputs[0].logprobs],
                               [lp for o in want_sampled for lp in o.outputs[0].logprobs], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose([lp for o in got for lp in o.outputs[0].logprobs], [lp for o in expected for lp in o.outputs[0].logprobs],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ops", ["reference", "pallas-interpret"])
def test_prefixed_chunk_attention_gives_the_same_tokens(stories, ops):
    """prefixed_chunk_attention: a step that is one sequence's chunk after its cached prefix (a long
    prompt's later chunks, a prefix-cache hit) runs the prefix and the chunk as two attentions merged by
    their log-sum-exps (mixed-prefixed / mixed-greedy-prefixed). Greedy and seeded sampled tokens and
    logprobs equal the engine's without it (float32), and nothing compiles after start-up."""
    system = "once upon a time there was a little girl named lily. she liked to play in the park. " * 2
    prompts = [system + "one day she", system + "the dog ran to the park and", "one day"]
    opts = dict(ops=ops, max_num_seqs=4, max_num_batched_tokens=32, greedy_mixed_step=True, progress=False,
                fresh_prompt_attention=True, fresh_prompt_min_tokens=16)
    llm = LLM(STORIES, prefixed_chunk_attention=True, compile_all_at_start=True, **opts)
    want = LLM(STORIES, compile_all_at_start=True, **opts)
    ran = record_steps(llm.engine.runner)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True, logprobs=2)
    with no_compiles():
        got = [llm.generate([p], params)[0] for params in (greedy, sampled) for p in prompts]
    assert "mixed-greedy-prefixed" in ran and "mixed-prefixed" in ran and "mixed-greedy-fresh" in ran
    expected = [want.generate([p], params)[0] for params in (greedy, sampled) for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    np.testing.assert_allclose([lp for o in got for lp in o.outputs[0].logprobs], [lp for o in expected for lp in o.outputs[0].logprobs],
                               rtol=1e-5, atol=1e-5)


def test_fresh_prompt_attention_only_from_its_smallest_bucket(stories):
    """fresh_prompt_min_tokens: below it the paged kernel was measured faster, so a short fresh prompt runs
    the plain greedy step and the fresh variant is compiled only for the token buckets from it up."""
    llm = LLM(STORIES, ops="reference", max_num_seqs=2, max_num_batched_tokens=64, greedy_mixed_step=True,
              fresh_prompt_attention=True, fresh_prompt_min_tokens=32, progress=False)
    r = llm.engine.runner
    assert r.token_buckets == [16, 32, 64]
    assert [t for t in r.token_buckets if r.has_one_sequence_step(t)] == [32, 64]
    assert {(v.name, bucket_of(batch)) for v, batch in r.bucket_calls() if v.name.endswith("-fresh")} == \
        {(name, t) for name in ("mixed-fresh", "mixed-greedy-fresh") for t in (32, 64)}
    ran = record_steps(r, lambda v, batch: (v.name, bucket_of(batch)))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate(["one day"], params)                                            # 16-token bucket
    llm.generate(["once upon a time there was a little girl named lily. " * 2], params)   # > 16 tokens
    mixed = [step for step in ran if step[0].startswith("mixed")]
    assert mixed[0] == ("mixed-greedy", 16) and mixed[1][0] == "mixed-greedy-fresh" and mixed[1][1] >= 32
    with pytest.raises(ValueError, match="fresh_prompt_min_tokens"):
        LLM(STORIES, ops="reference", fresh_prompt_min_tokens=0, progress=False)


def test_a_one_sequence_prompt_step_samples_its_one_row(stories):
    """A step that is one sequence's prompt (fresh or prefixed attention) samples its one row, not the
    max_num_seqs rows a step with decodes in it has (the sampler's cost grows with its rows: the sort over
    152k ids 0.18 ms at 1 row, 2.3 at 64 on the H200), and so picks the sampler that is cheapest at one
    row (sampling.SORT_MAX_ROWS): the sort where a step of every row takes the radix search (top-p alone)."""
    llm = LLM(STORIES, compile_all_at_start=True, ops="reference", max_num_seqs=4, max_num_batched_tokens=32, progress=False,
              fresh_prompt_attention=True, fresh_prompt_min_tokens=16, prefixed_chunk_attention=True,
              plain_sampling_step=True)
    r = llm.engine.runner
    V = r.cfg.vocab_size

    def logits_rows(name: str) -> set[int]:
        v, batch = next((v, b) for v, b in r.bucket_calls() if v.name == name)
        text = str(r.steps[v].trace(r.params, r.kv, r.state, batch).jaxpr)
        return {n for n in (1, 4) if f"f32[{n},{V}]" in text}

    for name in ("mixed-fresh", "mixed-plain-fresh", "mixed-prefixed"):
        assert logits_rows(name) == {1}, name
    assert 4 in logits_rows("mixed-filter") and logits_rows("mixed-filter-fresh") == {1}
    # the radix search's variants it would never run are not compiled: the one-row steps', decode's at 1-2 rows
    assert not {v.name for v in r.steps} & {"mixed-filter-p-fresh", "mixed-filter-p-prefixed"}
    assert {bucket_of(b) for v, b in r.bucket_calls() if v.name.startswith("decode-filter-p")} == {4}
    assert {bucket_of(b) for v, b in r.bucket_calls() if v.name.startswith("decode-filter-")} - {4}   # no search: all
    ran = record_steps(r)
    prompt = "once upon a time there was a little girl named lily. she liked to play"
    top_p = SamplingParams(max_tokens=4, temperature=0.6, top_p=0.9, seed=3, ignore_eos=True)
    top_k = SamplingParams(max_tokens=4, temperature=0.6, top_k=20, top_p=0.95, seed=3, ignore_eos=True)
    with no_compiles():
        llm.generate([prompt], top_p)                        # one sequence: its prompt step and decode sort
        llm.generate([prompt + " outside", "one day", "the dog ran"], top_p)   # 3 sequences: the search
    assert {"mixed-fresh", "mixed-filter-p", "decode-8", "decode-filter-p-8"} <= set(ran), ran
    ran.clear()
    with no_compiles():
        llm.generate([prompt], top_k)     # the filter without the search, one row too (the prompt is cached now)
    assert {"mixed-filter-prefixed", "decode-filter-8"} <= set(ran) and "decode-8" not in ran, ran


def test_without_compiling_at_start_only_the_steps_used_compile(stories):
    """The default (compile_all_at_start=False): start-up compiles no step; requests compile the steps they run,
    fewer than warm-up's, and get the tokens and logprobs of the engine that compiled everything at start."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    try:
        llm = LLM(STORIES, max_num_seqs=4, max_num_batched_tokens=64, progress=False, cache_dir="")
        assert not llm.engine.runner._executables     # warm-up's executables: none
        at_start = len(compiles)
        params = [SamplingParams(max_tokens=10, temperature=t, seed=2, ignore_eos=True) for t in (0, 0.9)]
        got = llm.generate(PROMPTS[:2], params)
        used = len(compiles) - at_start
    finally:
        jax.monitoring.clear_event_listeners()
    assert 0 < used < len(llm.engine.runner.bucket_calls())
    want = stories.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    np.testing.assert_allclose([lp for o in got for lp in o.outputs[0].logprobs], [lp for o in want for lp in o.outputs[0].logprobs],
                               rtol=1e-5, atol=1e-5)


def test_parallel_compilation_at_start_up_leaves_nothing_to_compile():
    """compile_threads > 1 compiles every step in a pool thread; each step's first call on the main
    thread must then find its executable in the cache, and later requests compile nothing."""
    import threading

    compiles = []   # True: on the main thread

    def listener(event, duration, **kw):
        if event.endswith("backend_compile_duration"):
            compiles.append(threading.current_thread() is threading.main_thread())

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        llm = LLM(STORIES, max_num_seqs=8, max_num_batched_tokens=128, progress=False, compile_threads=2,
                  cache_dir="", compile_all_at_start=True)
        r = llm.engine.runner
        steps = len(r.token_buckets) + 2 * len(r.batch_buckets)
        assert compiles.count(False) == steps
        assert compiles.count(True) < steps        # a few small helpers at most, no step twice
        n = len(compiles)
        params = [SamplingParams(max_tokens=12, temperature=t, seed=1) for t in (0, 0.8, 0)]
        outs = llm.generate(PROMPTS[:3], params)
        assert len(compiles) == n
    finally:
        jax.monitoring.clear_event_listeners()
    alone = LLM(STORIES, max_num_seqs=1, max_num_batched_tokens=32, progress=False).generate(PROMPTS[0], params[0])
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_a_failed_parallel_compilation_falls_back_to_the_main_thread(monkeypatch):
    def broken(self, *a, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(jax.stages.Lowered, "compile", broken)
    with pytest.warns(UserWarning, match="parallel compilation of a step failed"):
        llm = LLM(STORIES, max_num_seqs=2, max_num_batched_tokens=32, progress=False, compile_threads=2,
                  cache_dir="", compile_all_at_start=True)
    monkeypatch.undo()
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))[0]
    alone = LLM(STORIES, max_num_seqs=1, max_num_batched_tokens=32, progress=False).generate(
        PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_chunked_prefill_equals_one_shot():
    """A prompt longer than the token budget is prefilled chunk by chunk; the first sampled token's
    logprob and top logprobs (i.e. the last position's logits) equal a one-shot prefill's."""
    prompt = PROMPTS[4] * 3
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=10)
    outs = []
    for budget in (16, 512):
        llm = LLM(STORIES, max_num_seqs=2, max_num_batched_tokens=budget, progress=False)
        outs.append(llm.generate(prompt, params)[0])
    chunked, one_shot = outs
    assert len(chunked.prompt_token_ids) > 100           # several 16-token chunks
    assert chunked.outputs[0].token_ids == one_shot.outputs[0].token_ids
    np.testing.assert_allclose(chunked.outputs[0].logprobs, one_shot.outputs[0].logprobs, atol=1e-5)
    for a, b in zip(chunked.outputs[0].top_logprobs, one_shot.outputs[0].top_logprobs):
        assert [i for i, _ in a] == [i for i, _ in b]
        np.testing.assert_allclose([v for _, v in a], [v for _, v in b], atol=1e-5)


def test_prompt_logprobs_match_transformers():
    """Each prompt token's logprob (and the top ones) from transformers' logits of the same prompt,
    with the prompt split over several chunks and batched with another request."""
    golden = np.load(DATA / "golden" / "stories260k_logits.npz")
    llm = LLM(STORIES, max_num_seqs=2, max_num_batched_tokens=16, enable_prompt_logprobs=True, progress=False)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    outs = llm.generate([golden["prompt_1"].tolist(), golden["prompt_0"].tolist()], params)
    for out, i in zip(outs, (1, 0)):
        ids, logits = golden[f"prompt_{i}"], golden[f"logits_{i}"].astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for pos in range(1, len(ids)):
            value, top = out.prompt_logprobs[pos]
            assert abs(value - logp[pos - 1, ids[pos]]) < 1e-4
            assert [t for t, _ in top] == list(np.argsort(-logp[pos - 1], kind="stable")[:3])
    with pytest.raises(ValueError, match="enable_prompt_logprobs"):
        LLM(STORIES, max_num_seqs=1, progress=False).generate("Hi", params)


def test_a_dropped_engine_frees_its_buffers_without_a_garbage_collection():
    """No reference cycle keeps an engine (and its weights and KV pool) alive after its last user
    lets go: a second engine in the same process then finds the device memory free."""
    import gc
    import weakref

    from jaxinfer import LLM

    gc.disable()
    try:
        llm = LLM(STORIES, max_num_seqs=2, max_num_batched_tokens=32, decode_steps=2, progress=False)
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=3, temperature=0))
        kv = weakref.ref(llm.engine.runner)
        del llm
        assert kv() is None
    finally:
        gc.enable()


def test_kv_pool_from_device_memory_is_capped_by_what_the_sequences_can_use(monkeypatch):
    """On a device that reports its memory, the pool takes the free memory but at most twice what
    max_num_seqs full-length sequences use: a one-sequence engine must leave the steps their room."""
    import jaxinfer.engine.engine as E

    class Device:
        platform = "cpu"

        def memory_stats(self):
            return {"bytes_limit": 2**40, "bytes_in_use": 0}

    real = jax.local_devices
    monkeypatch.setattr(E.jax, "local_devices", lambda *a, **k: [Device()] if not (a or k) else real(*a, **k))
    engine = E.Engine(STORIES, max_num_seqs=2, max_model_len=64, progress=False, compile_threads=1)
    assert engine.pages.num_pages == 2 * 2 * (64 // 16) + 1


def test_the_penalty_row_is_reset_only_for_requests_with_penalties(stories):
    """A sequence's sampler row (prompt mask, output counts) is reset when it enters the batch only if its
    request has a penalty: without one the row is never read. A request with penalties in a row that a
    request without them left behind (one row: every request takes it) still gets its output alone."""
    llm = LLM(STORIES, max_num_seqs=1, max_num_batched_tokens=64, progress=False)
    r, starts = llm.engine.runner, []
    start_sequence = r.start_sequence
    r.start_sequence = lambda row, *a: (starts.append(row), start_sequence(row, *a))
    plain = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    penalised = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, **kw)
                 for kw in ({"repetition_penalty": 1.5}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0})]
    for params in penalised:
        starts.clear()
        got = [llm.generate([prompt], p)[0].outputs[0].token_ids for prompt, p in zip(PROMPTS[2:5], (plain, params, plain))]
        assert len(starts) == 1   # the penalised request's reset alone
        assert got[1] == stories.generate([PROMPTS[3]], params)[0].outputs[0].token_ids
        assert got[1] != stories.generate([PROMPTS[3]], plain)[0].outputs[0].token_ids   # the penalty shows
        assert got[2] == stories.generate([PROMPTS[4]], plain)[0].outputs[0].token_ids


@pytest.mark.parametrize("unroll_layers", [False, True])
def test_split_prompt_steps_give_the_same_outputs(unroll_layers, tmp_path):
    """prompt_step_head_layers: the one-sequence prompt steps run as two executables (the first 2 of the 5
    layers, then the rest and the sampling; runner.SplitStep), over stacked or per-layer weights. Fresh and
    prefixed steps, greedy and seeded sampled, give the tokens and logprobs of the engine without it; both parts
    compile at start-up (nothing after), each taking only its own layers' matrices, each saved to the executable
    cache under its own key."""
    system = "once upon a time there was a little girl named lily. she liked to play in the park. " * 2
    prompts = [system + "one day she", "the dog ran to the park and", "one day"]
    opts = dict(max_num_seqs=4, max_num_batched_tokens=32, greedy_mixed_step=True, progress=False,
                fresh_prompt_attention=True, fresh_prompt_min_tokens=16, prefixed_chunk_attention=True,
                unroll_layers=unroll_layers)
    llm = LLM(STORIES, prompt_step_head_layers=2, cache_dir=str(tmp_path), executable_cache=True,
              compile_all_at_start=True, **opts)
    want = LLM(STORIES, **opts)
    runner = llm.engine.runner
    split = runner.steps[StepVariant("mixed", "greedy", "fresh")]
    assert isinstance(split, SplitStep) and isinstance(runner.steps[StepVariant("mixed", "branch", "prefixed")], SplitStep)
    assert not isinstance(runner.steps[StepVariant("mixed", "greedy")], SplitStep)
    head, tail = split.split_params(runner.params)
    if unroll_layers:   # each part takes its own layers' matrices only
        assert [lp is None for lp in head["layers"]] == [False, False, True, True, True]
        assert [lp is None for lp in tail["layers"]] == [True, True, False, False, False]
        assert "final_norm" not in head and "final_norm" in tail
    ran = record_steps(runner)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True, logprobs=2)
    with no_compiles():
        got = [llm.generate([p], params)[0] for params in (greedy, sampled) for p in prompts]
    assert {"mixed-greedy-prefixed", "mixed-prefixed", "mixed-greedy-fresh", "mixed-fresh"} <= set(ran)
    expected = [want.generate([p], params)[0] for params in (greedy, sampled) for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    np.testing.assert_allclose([lp for o in got for lp in o.outputs[0].logprobs], [lp for o in expected for lp in o.outputs[0].logprobs],
                               rtol=1e-5, atol=1e-5)
    # each part compiled and saved apart (loading is test_executable_cache's, in processes of their own)
    parts = sorted({key.name for key in runner._executables if key.name.startswith("mixed-greedy-fresh")})
    assert parts == ["mixed-greedy-fresh/head", "mixed-greedy-fresh/tail"]
    saved = list((tmp_path / "executables").glob("*.exe"))
    assert len(saved) == len(runner._executables) == runner.executable_cache.misses
    # the benches' view of a step's executables (bench/step_memory.py): the two parts, warm-up's
    batch = next(b for v, b in runner.bucket_calls() if v.name == "mixed-greedy-fresh")
    compiled = runner.compiled(StepVariant("mixed", "greedy", "fresh"), batch)
    assert [k.name for k, _ in compiled] == parts and all(exe.memory_analysis() is not None for _, exe in compiled)


def test_outputs_have_vllms_shape_and_n_completions(stories):
    """LLM.generate returns one RequestOutput per prompt whose `outputs` holds n completions (vLLM's shape); a
    seeded request's i-th completion is the one its seed + i gives alone."""
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=11, n=3)
    out = stories.generate([PROMPTS[0], PROMPTS[1]], params)
    assert [len(o.outputs) for o in out] == [3, 3] and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert out[0].prompt == PROMPTS[0] and out[0].finished and out[0].prompt_token_ids
    for i, c in enumerate(out[1].outputs):
        alone = stories.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.9, seed=11 + i))[0]
        assert c.token_ids == alone.outputs[0].token_ids and c.text == alone.outputs[0].text
        assert c.cumulative_logprob == pytest.approx(sum(alone.outputs[0].logprobs))
    assert len({tuple(c.token_ids) for c in out[1].outputs}) > 1
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
