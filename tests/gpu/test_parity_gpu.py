"""On the GPU: the Pallas path's greedy output equals the reference path's (float32), and bf16 logits agree.

Run on the H200: PYTHONPATH=. python3 -m pytest -q tests/gpu  (stories260k copied to .carry/stories260k).
"""

import gc
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import record_steps
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.llm import LLM
from jaxinfer.pallas import tables
from bench.random_model import QWEN3_0_6B, write_random_model
from jaxinfer.sampling import SamplingParams

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")

REPO = Path(__file__).resolve().parents[2]
STORIES = next((p for p in (REPO / ".carry" / "stories260k", REPO.parent / "shared" / "models" / "stories260k")
                if p.is_dir()), None)
QWEN3_SMALL = {**QWEN3_0_6B, "num_hidden_layers": 4, "max_position_embeddings": 2048}
# Every engine here compiles only the steps it runs (compile_all_at_start=False, the default): warm-up would compile ~50
# per engine (every bucket of every sampling variant), most of this file's time (~950 s, 2026-11-30).


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("q") / "qwen3", QWEN3_SMALL, dtype="float32", std=0.05)


def _greedy(model_dir, ops, dtype, prompt, n, kv_cache_dtype="auto", logprobs=None):
    """The greedy token ids; with logprobs, the request's whole output (the top `logprobs` per token)."""
    llm = LLM(model_dir, dtype=dtype, ops=ops, max_num_seqs=2, max_model_len=512, max_num_batched_tokens=128,
              progress=False, skip_tokenizer_init=True, num_pages=2 * 512 // 16 + 1,
              kv_cache_dtype=kv_cache_dtype)
    out = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs))[0]
    del llm
    gc.collect()
    return out if logprobs else out.outputs[0].token_ids


@pytest.mark.parametrize("which,ops", [("stories", "pallas"), ("qwen3", "pallas")])
def test_pallas_greedy_equals_reference_float32(which, ops, qwen3_dir):
    model_dir = STORIES if which == "stories" else qwen3_dir
    prompt = [1, 403, 407, 261, 378] if which == "stories" else list(range(1000, 1040))
    ref = _greedy(model_dir, "reference", "float32", prompt, 256)
    pal = _greedy(model_dir, ops, "float32", prompt, 256)
    assert pal == ref


# Float8 K/V: where the two paths' float32 K/V straddle a rounding point of e4m3 (steps of 2^-3 relative),
# they store neighbouring values, which moves the logprobs by ~1e-3 (at most 1.6e-3 over 128 tokens of the
# random Qwen3, 2026-11-29, experiments/parity_margin.py). Greedy tokens may then part where
# the top two are that close (one run parted at token 109; XLA's autotuned GEMMs differ between
# processes): a parting is accepted only at a near tie, with the Pallas token the reference's second
# choice. A wrong kernel moves logprobs far more than the tolerance.
FLOAT8_TOLERANCE = 1e-2   # nats


@pytest.mark.parametrize("which", ["stories", "qwen3"])
def test_pallas_greedy_equals_reference_with_a_float8_cache(which, qwen3_dir):
    """Both paths store the same float8 K/V (to_cache: clip, round) and read them back alike: the same
    greedy tokens, or a parting at a near tie (FLOAT8_TOLERANCE)."""
    model_dir = STORIES if which == "stories" else qwen3_dir
    prompt = [1, 403, 407, 261, 378] if which == "stories" else list(range(1000, 1040))
    ref = _greedy(model_dir, "reference", "float32", prompt, 128, kv_cache_dtype="fp8", logprobs=2)
    pal = _greedy(model_dir, "pallas", "float32", prompt, 128, kv_cache_dtype="fp8", logprobs=2)
    _assert_same_tokens_or_a_near_tie(ref, pal, FLOAT8_TOLERANCE)


def _assert_same_tokens_or_a_near_tie(ref, got, tolerance):
    """Chosen-token logprobs within `tolerance` (nats) up to where the greedy tokens part, if they do; a
    parting only where the reference's top two are within it, with `got`'s token its second choice."""
    parts = next((i for i, (a, b) in enumerate(zip(ref.outputs[0].token_ids, got.outputs[0].token_ids)) if a != b), len(ref.outputs[0].token_ids))
    noise = max(abs(a - b) for a, b in zip(ref.outputs[0].logprobs[:parts], got.outputs[0].logprobs[:parts]))
    assert noise < tolerance, f"chosen-token logprobs differ by {noise:.2e} before token {parts}"
    if parts < len(ref.outputs[0].token_ids):
        top = sorted(ref.outputs[0].top_logprobs[parts], key=lambda t: -t[1])
        margin = top[0][1] - top[1][1]
        assert margin < tolerance and got.outputs[0].token_ids[parts] == top[1][0], \
            f"parted at token {parts} where the reference's top two are {margin:.2e} apart: {top}"


@pytest.mark.parametrize("kind", ["fresh", "prefixed"])
def test_a_prompt_on_cudnn_attention_is_as_close_to_float32_as_the_other_bf16_paths(kind, qwen3_dir):
    """fresh_prompt_attention: a 1,000-token prompt in bf16 whose prompt step runs cuDNN's flash attention;
    prefixed_chunk_attention: a 2,000-token prompt in steps of 1,024 whose second chunk runs two cuDNN
    attentions merged by log-sum-exp. bf16 paths differ from each other by rounding (2026-11-29:
    cuDNN against the paged kernel, 4.9e-2 nats within 8 tokens on this random Qwen3), so the bar is the
    float32 reference. The cuDNN attention runs only in the prompt step, whose output is the first token's
    distribution: there its top-20 logprobs stay as close to float32's as those of the bf16 paged kernel and
    the bf16 XLA path do (within 1.5x the larger), and so do the chosen-token logprobs of the tokens after,
    up to where any bf16 path parts from float32. The random model's distributions are flat, so near ties
    are common (2026-11-30: float32's top two 0.028 nats apart at the first token, where all three
    bf16 paths took the second): the cuDNN path may part from float32 where another bf16 path parts too, or
    at a near tie of the bar's size, with float32's second choice."""
    n = 1000 if kind == "fresh" else 2000
    prompt = [int(t) for t in np.random.default_rng(7).integers(100, 150000, n)]
    out = {}
    paths = [("float32", "float32", "reference", False), ("xla-bf16", "bfloat16", "reference", False),
             ("paged-bf16", "bfloat16", "pallas", False), ("cudnn-bf16", "bfloat16", "pallas", True)]
    # a fresh 1k prompt's attention runs the Mosaic GPU flash kernel where its table has the length (1,024 here),
    # cuDNN's with the table emptied: both against the same bar
    paths += [("flash-bf16", "bfloat16", "pallas", True)] if kind == "fresh" else []
    flash_table = list(tables.FRESH_PROMPT_FLASH)
    for name, dtype, ops, cudnn in paths:
        tables.FRESH_PROMPT_FLASH[:] = flash_table if name == "flash-bf16" else []
        jax.clear_caches()     # the table is read when a step is traced: no step traced before may be reused
        llm = LLM(qwen3_dir, dtype=dtype, ops=ops, max_num_seqs=1, max_model_len=n + 24,
                  max_num_batched_tokens=1024, token_buckets=[1024], progress=False, 
                  skip_tokenizer_init=True, executable_cache=False,   # each path compiled here, not loaded
                  fresh_prompt_attention=cudnn, prefixed_chunk_attention=cudnn)
        ran = record_steps(llm.engine.runner)
        out[name] = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=20))[0]
        # the step names carry the sampling variant too ("mixed-plain-fresh")
        assert any(n.startswith("mixed") and kind in n.split("-") for n in ran) == cudnn, ran
        del llm
        gc.collect()
    tables.FRESH_PROMPT_FLASH[:] = flash_table
    ref = out.pop("float32")

    def parting(o):
        return next((i for i, (a, b) in enumerate(zip(ref.outputs[0].token_ids, o.outputs[0].token_ids)) if a != b), len(ref.outputs[0].token_ids))

    def first_token_deviation(o):
        mine = dict(o.outputs[0].top_logprobs[0])
        common = [(lp, mine[t]) for t, lp in ref.outputs[0].top_logprobs[0] if t in mine]
        assert len(common) >= 10, (ref.outputs[0].top_logprobs[0], o.outputs[0].top_logprobs[0])
        return max(abs(a - b) for a, b in common)

    upto = min(parting(o) for o in out.values())
    dev = {k: max([first_token_deviation(o)] + [abs(a - b) for a, b in zip(ref.outputs[0].logprobs[:upto], o.outputs[0].logprobs[:upto])])
           for k, o in out.items()}
    partings = {k: parting(o) for k, o in out.items()}
    print(f"{kind}: bf16 paths against float32 (first token's top 20, then chosen tokens over {upto}): "
          f"at most {dev}; partings {partings}")
    bar = 1.5 * max(dev["xla-bf16"], dev["paged-bf16"]) + 1e-3
    for name in [k for k in ("cudnn-bf16", "flash-bf16") if k in out]:
        assert dev[name] <= bar, f"{name} {dev[name]:.2e} against the others' {dev}"
        got, i = out[name], partings[name]
        if i < min(partings["xla-bf16"], partings["paged-bf16"]):
            top = sorted(ref.outputs[0].top_logprobs[i], key=lambda t: -t[1])
            assert top[0][1] - top[1][1] < bar and got.outputs[0].token_ids[i] == top[1][0], (name, i, top, dev)


def test_prompt_steps_read_back_late_give_each_request_its_tokens_alone(qwen3_dir):
    """overlap_mixed on the GPU (with the greedy-only prompt step, a GPU default): 12 concurrent requests with
    prompt chunks of 64 tokens, each step launched before the one in flight is read back, give each
    request the tokens it gets alone on the synchronous engine."""
    opts = dict(dtype="float32", ops="pallas", max_model_len=512, max_num_batched_tokens=64, progress=False,
                
                skip_tokenizer_init=True)
    prompts = [list(range(1000 + 7 * i, 1000 + 7 * i + 30 + 11 * i)) for i in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(engine, batch):
        ids = [engine.add_request(p, params) for p in batch]
        while engine.has_unfinished():
            engine.step()
        return [engine.take_finished(i).outputs[0].token_ids for i in ids]

    alone_engine = Engine(qwen3_dir, max_num_seqs=1, **opts)
    alone = [run(alone_engine, [p])[0] for p in prompts]
    del alone_engine
    gc.collect()
    assert run(Engine(qwen3_dir, max_num_seqs=16, overlap_mixed=True, **opts), prompts) == alone


def test_newcomers_prompt_steps_behind_a_decode_dispatch_give_each_request_its_tokens_alone(qwen3_dir):
    """overlap_mixed on the GPU: requests arriving a few at a time while decode dispatches run have their
    prompt step launched behind the dispatch in flight, before it is read back; each request gets the
    tokens it gets alone on the synchronous engine."""
    import random

    opts = dict(dtype="float32", ops="pallas", max_model_len=512, max_num_batched_tokens=64, progress=False,
                
                skip_tokenizer_init=True, decode_steps=4)
    prompts = [list(range(1000 + 5 * i, 1000 + 5 * i + 20 + 9 * i)) for i in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone_engine = Engine(qwen3_dir, max_num_seqs=1, overlap_mixed=False, **opts)
    alone = []
    for p in prompts:
        rid = alone_engine.add_request(p, params)
        while alone_engine.has_unfinished():
            alone_engine.step()
        alone.append(alone_engine.take_finished(rid).outputs[0].token_ids)
    del alone_engine
    gc.collect()
    engine = Engine(qwen3_dir, max_num_seqs=16, overlap_mixed=True, prefill_behind_decode=True, **opts)
    behind = []
    launch = engine._launch_mixed
    engine._launch_mixed = lambda chunks: (behind.append(engine._inflight is not None), launch(chunks))[1]
    rng, ids, queue = random.Random(3), [], list(prompts)
    while queue or engine.has_unfinished():
        for _ in range(rng.choice([0] * 5 + [1]) if engine.has_unfinished() else 1):
            if queue:
                ids.append(engine.add_request(queue.pop(0), params))
        engine.step()
    assert [engine.take_finished(i).outputs[0].token_ids for i in ids] == alone
    assert sum(behind) >= 2


def test_sampling_steps_without_the_sort_draw_what_the_sorting_step_draws(qwen3_dir):
    """plain_sampling_step (a GPU default): seeded sampled requests (temperature and min-p: "-plain";
    top-k 20 with top-p 0.95, top-p alone: "-filter"; top-k 100: the sorting variant) and greedy ones wanting
    logprobs, 8 at once, give the tokens and logprobs of the engine with one sampling variant behind its
    device-side branch (float32, Pallas)."""
    opts = dict(dtype="float32", ops="pallas", max_num_seqs=8, max_model_len=512, max_num_batched_tokens=128,
                progress=False, skip_tokenizer_init=True)
    prompts = [list(range(1000 + 7 * i, 1000 + 7 * i + 20 + 5 * i)) for i in range(8)]
    kinds = [dict(temperature=0.8, min_p=0.05), dict(temperature=0.6, top_k=20, top_p=0.95),
             dict(temperature=0.7, top_p=0.9), dict(temperature=0, logprobs=2), dict(temperature=0.9, top_k=100)]
    params = [SamplingParams(max_tokens=32, ignore_eos=True, seed=11 + i, **kinds[i % 5]) for i in range(8)]
    out = {}
    for plain in (True, False):
        llm = LLM(qwen3_dir, plain_sampling_step=plain, **opts)
        ran = record_steps(llm.engine.runner)
        # each kind alone (its own variant), then all together (the sorting one)
        out[plain] = [llm.generate([p], [q])[0] for p, q in zip(prompts, params)] + llm.generate(prompts, params)
        assert any("-filter" in n for n in ran) == plain and any("-plain" in n for n in ran) == plain
        del llm
        gc.collect()
    assert [o.outputs[0].token_ids for o in out[True]] == [o.outputs[0].token_ids for o in out[False]]
    np.testing.assert_allclose([lp for o in out[True] for lp in o.outputs[0].logprobs],
                               [lp for o in out[False] for lp in o.outputs[0].logprobs], rtol=1e-4, atol=1e-4)
