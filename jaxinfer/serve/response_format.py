"""A request's structured-output fields as one StructuredOutput: OpenAI's `response_format`
({"type": "json_schema", "json_schema": {"name", "schema", "strict"}}, {"type": "json_object"}, {"type":
"text"}) and vLLM's extras (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), at most one
of them. Whether the schema, regex or grammar compiles is checked by the model's grammar compiler
(ModelInfo.check_structured); either way a bad one is a 400 naming the field and the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import StructuredOutput
from jaxinfer.serve.errors import bad_request
from jaxinfer.serve.protocol import _Sampling

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(rf: dict[str, Any]) -> StructuredOutput | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          param="response_format", code="invalid_value")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format: json_schema must be an object {name, schema, strict}",
                          param="response_format.json_schema", code="invalid_value")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format: json_schema.schema must be a JSON Schema (an object)",
                          param="response_format.json_schema.schema", code="invalid_value")
    return StructuredOutput(json=schema)


def structured_output(req: _Sampling, check: Callable[[StructuredOutput], Any] | None) -> StructuredOutput | None:
    """The request's constraint (None: free text), compiled once by `check` (the engine's grammar compiler; None:
    not checked here) so that a schema, regex or grammar it cannot handle is a 400 before the request is queued."""
    given = [name for name in GUIDED if getattr(req, name) is not None]
    rf = req.response_format
    if rf is not None and rf.get("type", "text") != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise bad_request(f"give one structured-output constraint, not {' and '.join(given)}", param=given[1],
                          code="invalid_value")
    if not given:
        return None
    param = given[0]
    try:
        constraint = _from_response_format(rf) if param == "response_format" else \
            StructuredOutput(**{GUIDED[param]: getattr(req, param)})
        if check is not None:
            check(constraint)
    except (JaxinferError, ValueError) as e:
        reason = str(e).removeprefix("structured ").removeprefix("structured.")
        raise bad_request(f"{param}: {reason}", param=param, code="invalid_value") from e
    return constraint
