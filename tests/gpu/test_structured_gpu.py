"""On the GPU: structured output on the Pallas path with the GPU's defaults (prompt steps read back late, the plain
samplers, one-sequence prompt steps, the executable cache): 32 requests of different JSON schemas in one batch all
validate, and greedy constrained output equals the reference path's.

Run on the H200: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_structured_gpu.py
(stories260k copied to .carry/stories260k; llguidance and jsonschema installed from carried wheels).
"""

import json
from pathlib import Path

import jax
import pytest

from jaxinfer.engine.llm import LLM
from jaxinfer.sampling import SamplingParams, StructuredOutput

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")

REPO = Path(__file__).resolve().parents[2]
STORIES = next((p for p in (REPO / ".carry" / "stories260k", REPO.parent / "shared" / "models" / "stories260k")
                if p.is_dir()), None)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "ok": {"type": "boolean"}},
     "required": ["code", "ok"], "additionalProperties": False},
]
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day"]


def _outputs(ops: str, temperatures) -> list:
    llm = LLM(STORIES, ops=ops, dtype="float32", max_num_seqs=32, max_num_batched_tokens=256, progress=False)
    params = [SamplingParams(max_tokens=160, temperature=temperatures[i % len(temperatures)], seed=i,
                             structured=StructuredOutput(json={**SCHEMAS[i % len(SCHEMAS)], "title": f"s{i}"}))
              for i in range(32)]
    return [o.outputs[0] for o in llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(32)], params)]


def test_32_constrained_requests_validate_on_the_pallas_path():
    jsonschema = pytest.importorskip("jsonschema")
    for i, out in enumerate(_outputs("pallas", (0.0, 0.7, 1.0))):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMAS[i % len(SCHEMAS)])


def test_greedy_constrained_output_equals_the_reference_path():
    assert [o.token_ids for o in _outputs("pallas", (0.0,))] == [o.token_ids for o in _outputs("reference", (0.0,))]
