"""Structured output end to end on stories260k (real weights, a 512-token Llama-2 tokenizer): every sampled
output parses and validates against its JSON Schema at several temperatures and with 32 requests of different
schemas in one batch; regex, choice and grammar outputs match; unconstrained requests beside constrained
ones are unchanged and unconstrained batches never take a masked step."""

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest

from conftest import REPO, SHARED, STORIES, record_steps
from jaxinfer import LLM, SamplingParams
from jaxinfer.sampling import StructuredOutput
from jaxinfer.sampling.sample import SamplingArrays, apply_bitmask, sample
from jaxinfer.sampling.structured import StructuredOutputError, allocate_bitmask

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    # nested objects, required fields
    {"type": "object", "properties": {"name": NAME, "pet": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
        "required": ["kind", "legs"], "additionalProperties": False}},
     "required": ["name", "pet"], "additionalProperties": False},
    # arrays of enums, bounded lengths
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    # bounded numbers and integers (a number with a multipleOf: a small model left free to add fraction digits
    # may never stop)
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25},
                                      "rank": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["score", "rank"], "additionalProperties": False},
    # strings with patterns, a boolean
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "ok": {"type": "boolean"}},
     "required": ["code", "ok"], "additionalProperties": False},
    # an array of objects
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                        "maximum": 9}, "tag": NAME},
                                "required": ["id"], "additionalProperties": False}, "maxItems": 2},
]
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day"]


@pytest.fixture(scope="module")
def llm():
    return LLM(STORIES, max_num_seqs=8, max_num_batched_tokens=64, progress=False)


def _valid(out, schema) -> None:
    c = out.outputs[0]
    assert c.finish_reason == "stop", (c.text, c.finish_reason)
    jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_every_output_validates_against_its_schema(llm, temperature):
    params = [SamplingParams(max_tokens=160, temperature=temperature, seed=i, structured=StructuredOutput(json=s))
              for i, s in enumerate(SCHEMAS)]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))], params)
    for out, schema in zip(outs, SCHEMAS):
        _valid(out, schema)


def test_32_requests_of_different_schemas_in_one_batch():
    llm = LLM(STORIES, max_num_seqs=32, max_num_batched_tokens=256, progress=False)
    schemas = [dict(SCHEMAS[i % len(SCHEMAS)]) for i in range(32)]
    for i, s in enumerate(schemas):   # 32 distinct schemas: each a title of its own
        s["title"] = f"schema {i}"
    params = [SamplingParams(max_tokens=160, temperature=(0.0, 0.7, 1.0)[i % 3], seed=i,
                             structured=StructuredOutput(json=s)) for i, s in enumerate(schemas)]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(32)], params)
    for out, schema in zip(outs, schemas):
        _valid(out, schema)
    assert llm.engine.runner._masked_samples   # decode steps took the constrained dispatches
    assert llm.engine.constraints.masks >= sum(len(o.outputs[0].token_ids) for o in outs)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [(StructuredOutput(regex=r"(cat|dog)s? [0-9]{2,3}!"), lambda t: re.fullmatch(r"(cat|dog)s? [0-9]{2,3}!", t)),
             (StructuredOutput(choice=["Lily", "Tom", "the big red ball"]), lambda t: t in ("Lily", "Tom", "the big red ball")),
             (StructuredOutput(grammar='start: "say " WORD ("," WORD)~0..2 "."\nWORD: /[a-z]{1,6}/'),
              lambda t: re.fullmatch(r"say [a-z]{1,6}(,[a-z]{1,6}){0,2}\.", t))]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=200, temperature=temperature, seed=3, structured=s) for s, _ in cases]
        for out, (s, ok) in zip(llm.generate(PROMPTS[:len(cases)], params), cases):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (s, c.text, c.finish_reason)


def test_json_object(llm):
    """Any JSON object: unbounded, so this model may run out of tokens inside one (keys repeating); what it
    finishes parses as an object, what it does not is an object's beginning."""
    params = [SamplingParams(max_tokens=120, temperature=t, seed=s, structured=StructuredOutput(json_object=True))
              for t in (0.0, 1.0) for s in (0, 1)]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    for c in outs:
        assert isinstance(json.loads(c.text), dict) if c.finish_reason == "stop" else c.text.startswith("{"), c.text


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm):
    plain = SamplingParams(max_tokens=40, temperature=0.0)
    alone = llm.generate(PROMPTS[:2], plain)
    constrained = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput(json=SCHEMAS[1]))
    together = llm.generate(PROMPTS[:2] + PROMPTS[2:], [plain, plain, constrained, constrained])
    for a, t in zip(alone, together[:2]):
        assert a.outputs[0].token_ids == t.outputs[0].token_ids


def test_unconstrained_batches_take_no_masked_step(llm):
    ran = record_steps(llm.engine.runner)
    llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.7, seed=0))
    assert ran and not any("masked" in name for name in ran), ran


def test_invalid_constraint_is_refused_when_added(llm):
    with pytest.raises(StructuredOutputError, match="unclosed group"):
        llm.generate(PROMPTS[0], SamplingParams(structured=StructuredOutput(regex="a(b")))
    with pytest.raises(StructuredOutputError, match="frobnicate"):
        llm.generate(PROMPTS[0], SamplingParams(structured=StructuredOutput(json={"type": "frobnicate"})))
    assert not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def spec_llm():
    """stories260k with n-gram speculation, every proposal verified (the cost model would skip some on the CPU)."""
    llm = LLM(STORIES, speculative="ngram", num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64,
              progress=False)
    llm.engine.speculator.adaptive = False
    return llm


def _echo_prompts(llm, params) -> list[str]:
    """Prompts that hold each request's own greedy output once (so that n-gram proposals find it), with the schemas'
    outputs of `llm` (no speculation)."""
    first = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    return [f"{PROMPTS[i % len(PROMPTS)]} {o.outputs[0].text} {PROMPTS[(i + 1) % len(PROMPTS)]}"
            for i, o in enumerate(first)]


def test_greedy_constrained_output_is_the_same_with_speculation(llm, spec_llm):
    """Greedy constrained requests with n-gram drafts (cut to what each grammar allows, one mask a verified row)
    give token for token what they give without speculation, at every schema, beside an unconstrained request;
    every output validates, and drafts were verified and accepted for them under masked verify steps."""
    params = [SamplingParams(max_tokens=160, temperature=0.0, structured=StructuredOutput(json=s)) for s in SCHEMAS]
    prompts = _echo_prompts(llm, params)
    plain = SamplingParams(max_tokens=40, temperature=0.0)
    off = llm.generate(prompts + PROMPTS[:1], params + [plain])
    stats = spec_llm.engine.speculator.stats
    drafted, accepted = stats.drafted, stats.accepted
    ran = record_steps(spec_llm.engine.runner)
    on = spec_llm.generate(prompts + PROMPTS[:1], params + [plain])
    for a, b, schema in zip(off, on, SCHEMAS):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].text, b.outputs[0].text)
        _valid(b, schema)
    assert on[-1].outputs[0].token_ids == off[-1].outputs[0].token_ids
    assert stats.drafted > drafted and stats.accepted > accepted, (stats.drafted - drafted, stats.accepted - accepted)
    assert any(name.startswith("verify") and "masked" in name for name in ran), ran


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_constrained_output_with_speculation_validates(llm, spec_llm, temperature):
    """Seeded sampled constrained requests under n-gram speculation: every output validates (and, the draw coupled
    to plain sampling's, is the one it gives without speculation)."""
    params = [SamplingParams(max_tokens=160, temperature=temperature, seed=i, structured=StructuredOutput(json=s))
              for i, s in enumerate(SCHEMAS)]
    prompts = _echo_prompts(llm, [dataclasses.replace(p, temperature=0.0) for p in params])
    on = spec_llm.generate(prompts, params)
    for out, schema in zip(on, SCHEMAS):
        _valid(out, schema)
    off = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_chained_verify_steps_leave_constrained_batches_alone():
    """Tuning.chain_verify (a verify step launched before the one before it is read back) never chains a batch that
    holds a constrained request (its masks need the tokens before it): none chained, outputs valid."""
    llm = LLM(STORIES, speculative="ngram", num_speculative_tokens=3, max_num_seqs=4, max_num_batched_tokens=64,
              chain_verify=True, progress=False)
    llm.engine.speculator.adaptive = False
    params = [SamplingParams(max_tokens=160, temperature=0.0, structured=StructuredOutput(json=s)) for s in SCHEMAS[:2]]
    e = llm.engine
    chained = []   # per chained verify step: whether it carried a constrained request
    launch = e._launch_verify

    def launch_verify(chunks, drafts, dense, assumed=None):
        if assumed:
            chained.append(any(seq.grammar is not None for seq, _ in chunks))
        return launch(chunks, drafts, dense, assumed)
    e._launch_verify = launch_verify
    story = llm.generate(PROMPTS[0], SamplingParams(max_tokens=60, temperature=0.0))[0].outputs[0].text
    assert chained   # an unconstrained request alone chains
    plain = SamplingParams(max_tokens=60, temperature=0.0)
    verified = e.speculator.stats.verify_steps
    outs = llm.generate(PROMPTS[:2] + [PROMPTS[0] + story + PROMPTS[0]], params + [plain])
    for out, schema in zip(outs, SCHEMAS[:2]):
        _valid(out, schema)
    assert e.speculator.stats.verify_steps > verified and not any(chained)


def test_bitmask_drops_the_tokens_whose_bit_is_clear():
    rng = np.random.default_rng(0)
    V = 77   # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = rng.normal(size=(3, V)).astype(np.float32)
    mask = allocate_bitmask(3, V)
    allowed = rng.random((2, V)) < 0.2
    allowed[:, 76] = True   # bit 12 of word 2; and bit 31 of a word below
    allowed[:, 31] = True
    for b in range(2):
        mask[b] = 0
        for t in np.nonzero(allowed[b])[0]:
            mask[b, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    out = np.asarray(apply_bitmask(logits, mask))
    assert np.array_equal(np.isfinite(out[:2]), allowed) and np.array_equal(out[2], logits[2])
    arrays = SamplingArrays.from_params([SamplingParams(temperature=t) for t in (0.0, 1.0, 0.0)], [1, 2, 3], 3)
    zeros = np.zeros((3, V), bool), np.zeros((3, V), np.int32)
    for method in ("branch", "plain"):
        tokens, _ = sample(logits, arrays, np.zeros(3, np.int32), *zeros, method=method, bitmask=mask)
        assert allowed[0, tokens[0]] and allowed[1, tokens[1]] and tokens[2] == np.argmax(logits[2])


def _random_bitmask(rng, rows: int, V: int, share: float) -> tuple[np.ndarray, np.ndarray]:
    """(bitmask [rows, ceil(V / 32)], allowed [rows, V]): each token allowed with probability `share`, at least one."""
    allowed = rng.random((rows, V)) < share
    allowed[np.arange(rows), rng.integers(0, V, rows)] = True
    mask = np.zeros((rows, -(-V // 32)), np.int32)
    for r, t in zip(*np.nonzero(allowed)):
        mask[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask, allowed


@pytest.mark.parametrize("method", ["branch", "sort"])
@pytest.mark.parametrize("seed", range(2))
def test_verify_under_masks_takes_the_tokens_sample_takes_under_them(method, seed):
    """A verify step's acceptance with one mask a scored row (structured output under speculative decoding): every
    token it emits is the one `sample` takes at that row under that row's mask (greedy: the argmax among the allowed;
    sampled: the same Gumbel draw from the masked, renormalised distribution), drafts are accepted while they equal
    it, and each emitted token is allowed."""
    from jaxinfer.sampling.rejection import verify

    rng = np.random.default_rng(seed)
    B, Q, V = 4, 4, 77
    logits = rng.normal(size=(B, Q, V)).astype(np.float32) * 3
    mask, allowed = _random_bitmask(rng, B * Q, V, 0.15)
    masked = np.where(allowed.reshape(B, Q, V), logits, -np.inf)
    # drafts: row b's first b drafts are its masked argmax (greedy rows accept them), then one that is not
    drafts = np.zeros((B, Q - 1), np.int32)
    for b in range(B):
        for j in range(Q - 1):
            best = int(np.argmax(masked[b, j]))
            drafts[b, j] = best if j < b else (best + 1) % V
    num_drafts = np.full(B, Q - 1, np.int32)
    arrays = SamplingArrays.from_params([SamplingParams(temperature=t, seed=b) for b, t in enumerate((0.0, 1.0, 0.0, 0.7))],
                                        list(range(B)), B)
    step_index = np.arange(B, dtype=np.int32) * 3
    pm, oc = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
    accepted, tokens, _ = verify(logits, drafts, num_drafts, arrays, step_index, pm, oc, method=method,
                                 bitmask=mask.reshape(B, Q, -1))
    accepted, tokens = np.asarray(accepted), np.asarray(tokens)
    for b in range(B):
        one = SamplingArrays.from_params([SamplingParams(temperature=float(arrays.temperature[b]), seed=b)], [b], 1)
        expected = [int(sample(logits[b, j:j + 1], one, step_index[b:b + 1] + j, pm[:1], oc[:1], method=method,
                               bitmask=mask[b * Q + j:b * Q + j + 1])[0][0]) for j in range(Q)]
        a = int(accepted[b])
        assert a == next((j for j in range(Q - 1) if drafts[b, j] != expected[j]), Q - 1), (b, a, expected)
        assert tokens[b, :a + 1].tolist() == expected[:a + 1], b
        assert all(allowed[b * Q + j, tokens[b, j]] for j in range(a + 1))
    assert accepted[0] == 0 and accepted[2] == 2   # greedy rows: exactly their masked argmaxes


def test_gpu_scheduling_paths_keep_outputs_valid():
    """The GPU's defaults (prompt steps read back one step late, newcomers' prompts launched behind a decode
    dispatch, the plain samplers, one-sequence prompt steps) with more requests than rows and a KV pool small
    enough to preempt: constrained sequences still get a mask for every token."""
    llm = LLM(STORIES, max_num_seqs=4, max_num_batched_tokens=32, overlap_mixed=True, prefill_behind_decode=True,
              plain_sampling_step=True, greedy_mixed_step=True, fresh_prompt_attention=True, fresh_prompt_min_tokens=16,
              num_pages=21, page_size=16, max_model_len=320, progress=False)
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(10)]
    params = [SamplingParams(max_tokens=160, temperature=(0.0, 1.0)[i % 2], seed=i, top_k=(0, 20)[i % 2],
                             structured=StructuredOutput(json=s)) for i, s in enumerate(schemas)]
    plain = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)   # these two take the pool
    prompts = [" ".join([PROMPTS[i % len(PROMPTS)]] * (1 + 3 * (i % 3))) for i in range(12)]
    outs = llm.generate(prompts, [plain, plain] + params)
    for out, schema in zip(outs[2:], schemas):
        _valid(out, schema)
    assert llm.engine.scheduler.num_preemptions > 0


def test_bench_structured_cpu_smoke(tmp_path):
    """bench/structured.py end to end at a tiny shape (its figures mean nothing here)."""
    import os
    import subprocess
    import sys

    repo = REPO
    r = subprocess.run([sys.executable, str(repo / "bench" / "structured.py"), "--shape", "tiny", "--batch", "2",
                        "--context", "8", "--steps", "4", "--lazy-compile", "--models", str(tmp_path / "models"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "structured.json").read_text())
    assert out["end_to_end"]["json schema each"]["tokens"] == out["end_to_end"]["unconstrained"]["tokens"] == 8
    # the mask time a step is a difference of two runs' llguidance times (0.1-4 ms a fill with the machine's load):
    # any sign on a loaded 2-core machine; without constraints no mask is filled at all
    assert out["end_to_end"]["unconstrained"]["mask_ms_per_step"] == 0
    assert np.isfinite(out["end_to_end"]["json schema each"]["mask_ms_per_step"]) and out["device"]["masked"] > 0


def test_generate_command_takes_a_constraint(tmp_path):
    import subprocess
    import sys

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS[1]))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(STORIES), "--max-tokens",
                               "100", *args, "Once upon a time"], capture_output=True, text=True, timeout=300)

    r = run("--json-schema", str(schema))
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout.removeprefix("Once upon a time").strip()), SCHEMAS[1])
    r = run("--choice", "yes", "--choice", "no")
    assert r.returncode == 0 and r.stdout.strip().removeprefix("Once upon a time") in ("yes", "no"), r.stdout
    r = run("--regex", "a(b")
    assert r.returncode == 2 and "unclosed group" in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr


def test_constrained_decode_steps_chain(llm):
    """A constrained step's forward pass is launched before the previous token is read back (its masks are made
    while it runs): one engine step a token, not a launch step and a read-back step."""
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                                                        structured=StructuredOutput(regex="[a-z]{40}")))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    out = engine.take_finished(rid)
    assert re.fullmatch("[a-z]{40}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    assert steps <= len(out.outputs[0].token_ids) + 4, steps


def test_engines_without_constrained_requests_do_not_need_llguidance():
    """The grammar engine is imported on the first constrained request (the GPU machine's image may lack it)."""
    import subprocess
    import sys

    code = "import sys, jaxinfer.engine.engine, jaxinfer.serve.app, jaxinfer.cli; print('llguidance' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    from jaxinfer.engine.constraints import Constraints

    assert np.array_equal(Constraints(None, 77, [0]).allow_all(3), allocate_bitmask(3, 77))


def test_constrained_output_with_a_draft_model_under_the_gpu_defaults(llm):
    """A draft model's greedy drafts (which may hold the end of the sequence) cut to what each grammar allows, under
    the GPU's scheduling defaults in a pool small enough to preempt, beside an unconstrained request taking the pool:
    greedy and seeded constrained outputs are token for token those without speculation, and validate."""
    spec = LLM(STORIES, speculative=f"draft:{SHARED / 'models' / 'llama2xs-260k'}", num_speculative_tokens=4,
               max_num_seqs=4, max_num_batched_tokens=32, overlap_mixed=True, prefill_behind_decode=True,
               num_pages=14, page_size=16, max_model_len=192, progress=False)
    spec.engine.speculator.adaptive = False
    params = [SamplingParams(max_tokens=96, temperature=t, seed=i, structured=StructuredOutput(json=SCHEMAS[i]))
              for i, t in enumerate((0.0, 0.7, 0.0))]
    filler = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    prompts = [" ".join([PROMPTS[i % len(PROMPTS)]] * (1 + 2 * (i % 2))) for i in range(4)]
    on = spec.generate(prompts, [filler] + params)
    off = llm.generate(prompts, [filler] + params)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    for out, schema in zip(on[1:], SCHEMAS):
        _valid(out, schema)
    assert spec.engine.speculator.stats.accepted > 0 and spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.pages.num_in_use == 0
