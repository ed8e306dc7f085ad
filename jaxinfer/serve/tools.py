"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` checked, the grammar that makes a required or
named call parse, and the model's output parsed back into OpenAI `tool_calls`.

Two call formats, picked from the chat template: Qwen2.5 / Qwen3's (Hermes) `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>` (one block a call) where the template writes `<tool_call>`, else Llama 3's
JSON form, the whole reply one object `{"name": ..., "parameters": {...}}`. tool_choice "auto" lets the model
choose and parses what it wrote; "required" and a named function constrain the output to a call whose arguments
follow the function's `parameters` schema (a Lark grammar with llguidance's `%json` rule), so it always parses;
"none" parses nothing.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxinfer.sampling import StructuredOutput
from jaxinfer.serve.errors import bad_request

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass
class ToolUse:
    """What a chat request's tools ask of its reply: the call format, whether to parse calls, the functions."""

    format: str
    parse: bool
    functions: list[dict[str, Any]]   # {"name", "parameters"} each


def call_format(template_text: str) -> str:
    return HERMES if HERMES_OPEN in template_text else LLAMA3_JSON


def tool_use(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
             template_text: str, marker_ids: tuple[int | None, int | None] = (None, None),
             ) -> tuple[ToolUse | None, StructuredOutput | None]:
    """The request's tools checked (a 400 naming the field otherwise): how its reply is parsed, and the constraint
    a required or named call puts on it (None for auto and none). marker_ids: the tokenizer's ids of
    `<tool_call>` and `</tool_call>` where each is one token (Qwen's): the grammar names those tokens (llguidance
    takes a special token only by id, not for the text it decodes to)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None, None
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                              param=f"tools[{i}]", code="invalid_value")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema (an object)",
                              param=f"tools[{i}].function.parameters", code="invalid_value")
        functions.append({"name": fn["name"], "parameters": params})
    names = [f["name"] for f in functions]
    fmt = call_format(template_text)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise bad_request(f"tool_choice: no function named {name!r} among the tools ({', '.join(names)})",
                              param="tool_choice", code="invalid_value")
        return ToolUse(fmt, True, functions), _call_grammar([f for f in functions if f["name"] == name], fmt,
                                                            marker_ids)
    if choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                          param="tool_choice", code="invalid_value")
    if choice == "required":
        return ToolUse(fmt, True, functions), _call_grammar(functions, fmt, marker_ids)
    return ToolUse(fmt, choice == "auto", functions), None


def _call_grammar(functions: list[dict[str, Any]], fmt: str,
                  marker_ids: tuple[int | None, int | None] = (None, None)) -> StructuredOutput:
    """One call to one of these functions, its arguments following their parameters schema."""
    key = "arguments" if fmt == HERMES else "parameters"
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
              "required": ["name", key], "additionalProperties": False} for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # compact JSON, as sampling.structured compiles a schema (a %json rule in Lark takes its options from here)
    schema = json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
    if fmt == HERMES:
        open_, close = (f"<[{i}]>" if i is not None else json.dumps(text)
                        for i, text in zip(marker_ids, (HERMES_OPEN, HERMES_CLOSE)))
        return StructuredOutput(grammar=f'start: {open_} "\\n" call "\\n" {close}\ncall: %json {schema}')
    return StructuredOutput(json=schema)


def parse_tool_calls(text: str, use: ToolUse) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply: the text outside the calls (None if empty) and the OpenAI tool calls of
    what parses as a call to a known function (a block that does not parse stays in the content)."""
    names = {f["name"] for f in use.functions}
    if not use.parse:
        return text, []
    if use.format == HERMES:
        calls, kept, last = [], [], 0
        for m in _HERMES_CALL.finditer(text):
            call = _call_of(m.group(1), names, "arguments")
            if call is None:
                continue
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        if not calls:
            return text, []
        content = ("".join(kept) + text[last:]).strip()
        return content or None, calls
    call = _call_of(text.strip(), names, "parameters")
    return (None, [call]) if call is not None else (text, [])


def _call_of(blob: str, names: set[str], key: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(blob)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def held_back(text: str, use: ToolUse) -> int:
    """Where a streamed reply's text may start a tool call: the content before it can be sent, the rest waits for
    the end of the reply (its calls are sent whole, as one delta each)."""
    if not use.parse:
        return len(text)
    if use.format == LLAMA3_JSON:
        return 0 if text.lstrip().startswith("{") or not text.strip() else len(text)
    at = text.find(HERMES_OPEN)
    if at >= 0:
        return at
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):   # a marker's beginning at the end
        if text.endswith(HERMES_OPEN[:k]):
            return len(text) - k
    return len(text)
