"""On the GPU: structured output under n-gram speculative decoding on the Pallas path with the GPU's defaults
(chained verify steps among them, which must leave constrained batches alone): 16 greedy constrained requests give
token for token what they give without speculation, and seeded sampled ones all validate; drafts were verified.

Run on the H200: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_structured_spec_gpu.py
(stories260k copied to .carry/stories260k; llguidance and jsonschema installed from carried wheels).
"""

import json

import jax
import pytest

from jaxinfer.engine.llm import LLM
from jaxinfer.sampling import SamplingParams, StructuredOutput
from tests.gpu.test_structured_gpu import PROMPTS, SCHEMAS, STORIES

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")
N = 16


def _params(temperatures) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=160, temperature=temperatures[i % len(temperatures)], seed=i,
                           structured=StructuredOutput(json={**SCHEMAS[i % len(SCHEMAS)], "title": f"s{i}"}))
            for i in range(N)]


def _llm(**settings) -> LLM:
    return LLM(STORIES, ops="pallas", dtype="float32", max_num_seqs=N, max_num_batched_tokens=256, progress=False,
               **settings)


def test_constrained_outputs_with_and_without_speculation():
    jsonschema = pytest.importorskip("jsonschema")
    plain = _llm()
    greedy = _params((0.0,))
    first = plain.generate([PROMPTS[i % len(PROMPTS)] for i in range(N)], greedy)
    # each prompt holds its request's own output once, so that n-gram proposals find it
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {o.outputs[0].text} {PROMPTS[(i + 1) % len(PROMPTS)]}"
               for i, o in enumerate(first)]
    off = plain.generate(prompts, greedy)
    del plain
    spec = _llm(speculative="ngram", num_speculative_tokens=3)
    spec.engine.speculator.adaptive = False   # every proposal verified
    on = spec.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    sampled = spec.generate(prompts, _params((0.7, 1.0)))
    for i, out in enumerate(on + sampled):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMAS[i % N % len(SCHEMAS)])
    assert spec.engine.speculator.stats.accepted > 0
