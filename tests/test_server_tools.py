"""Tool calling on /v1/chat/completions through the official `openai` client: a tiny random Qwen3 with the real
Qwen3 tokenizer and chat template. A required or named call is constrained by the function's parameters, so its
arguments parse and validate, streamed or not; the call formats parse back (serve/tools.py); bad tools are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import write_tiny_qwen3

from jaxinfer.engine.engine import Engine
from jaxinfer.serve.app import create_app
from jaxinfer.serve.server import ServerThread
from jaxinfer.serve.tools import HERMES, LLAMA3_JSON, ToolUse, held_back, parse_tool_calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    d = write_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), max_position_embeddings=1024)
    server = ServerThread(create_app(Engine(d, max_num_seqs=4, max_num_batched_tokens=512, progress=False),
                                     served_model_name="qwen3-tiny")).start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def _check_calls(calls, names) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.function.name in names and c.id
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_required_and_named_calls_parse(api, tool_choice, names):
    r = api.chat.completions.create(model="qwen3-tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                    max_tokens=200, temperature=1.0, seed=5, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message.tool_calls, names)


def test_streamed_call_equals_the_whole_one(api):
    kw = dict(model="qwen3-tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
              temperature=0.8, seed=9)
    whole = api.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, content, finish = [], "", None
    for chunk in api.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and not content.strip()
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_auto_and_none_answer_and_a_conversation_with_calls_renders(api):
    for choice in ("auto", "none"):
        r = api.chat.completions.create(model="qwen3-tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                        max_tokens=20, temperature=0.0)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = api.chat.completions.create(model="qwen3-tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0.0)
    assert r.usage.prompt_tokens > 0


@pytest.mark.parametrize("kw, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function"}]), "tools[0]"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
          tool_choice="required"), "tools"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_bad_tools_are_400(api, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="qwen3-tiny", messages=MESSAGES, max_tokens=8, **kw)
    assert e.value.body["param"] == param, e.value.body


FUNCTIONS = [{"name": "get_weather", "parameters": WEATHER}]


def test_parse_hermes_calls():
    use = ToolUse(HERMES, True, FUNCTIONS)
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text, use)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo", "unit": "celsius"}]
    assert content.startswith("Let me look.") and "unknown" in content   # a call to no known function stays text
    assert parse_tool_calls("<tool_call>\n{not json\n</tool_call>", use) == ("<tool_call>\n{not json\n</tool_call>", [])
    assert parse_tool_calls(text, ToolUse(HERMES, False, FUNCTIONS)) == (text, [])


def test_parse_llama3_json_call():
    use = ToolUse(LLAMA3_JSON, True, FUNCTIONS)
    content, calls = parse_tool_calls(' {"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}', use)
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "unit": "celsius"}
    assert parse_tool_calls("It is sunny.", use) == ("It is sunny.", [])


def test_streaming_holds_back_what_may_be_a_call():
    use = ToolUse(HERMES, True, FUNCTIONS)
    assert held_back("Hello", use) == 5
    assert held_back("Hello <tool", use) == 6
    assert held_back("Hello <tool_call>\n{", use) == 6
    llama = ToolUse(LLAMA3_JSON, True, FUNCTIONS)
    assert held_back("  {\"na", llama) == 0 and held_back("Sure", llama) == 4
