"""Structured output through the server and the official `openai` client: response_format (json_schema,
json_object) on both endpoints, streaming and not, vLLM's guided_* extras, and 400s that say what is wrong
with a schema, regex or grammar (the server keeps serving)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from conftest import STORIES

from jaxinfer.engine.engine import Engine
from jaxinfer.serve.app import create_app
from jaxinfer.serve.server import ServerThread

PLAIN_TEMPLATE = "{{ bos_token }}{{ messages | map(attribute='content') | join('\\n') }}"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                             "age": {"type": "integer", "minimum": 1, "maximum": 15}},
            "required": ["kind", "age"], "additionalProperties": False}},
    "required": ["name", "pet"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    engine = Engine(STORIES, max_num_seqs=8, max_num_batched_tokens=64, progress=False)
    s = ServerThread(create_app(engine, chat_template=template)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema(api, temperature):
    r = api.chat.completions.create(model="stories260k", messages=MESSAGES, max_tokens=150, temperature=temperature,
                                    seed=1, n=2, response_format=JSON_SCHEMA)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_schema_streamed_equals_not_streamed(api):
    kw = dict(model="stories260k", messages=MESSAGES, max_tokens=150, temperature=0.8, seed=7, response_format=JSON_SCHEMA)
    whole = api.chat.completions.create(**kw).choices[0].message.content
    parts, finish = [], None
    for chunk in api.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == whole and finish == "stop"
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_completions_response_format_and_guided_extras(api):
    def text(**extra):
        r = api.completions.create(model="stories260k", prompt="The little dog", max_tokens=150, temperature=1.0,
                                   seed=3, extra_body=extra)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].text

    jsonschema.validate(json.loads(text(response_format=JSON_SCHEMA)), SCHEMA)
    jsonschema.validate(json.loads(text(guided_json=SCHEMA)), SCHEMA)
    assert re.fullmatch(r"[A-Z][a-z]{2,5} is [0-9]{1,2}\.", text(guided_regex=r"[A-Z][a-z]{2,5} is [0-9]{1,2}\."))
    assert text(guided_choice=["happy", "sad", "sleepy"]) in ("happy", "sad", "sleepy")
    assert re.fullmatch(r"\((yes|no)( (yes|no))*\)", text(guided_grammar='start: "(" W (" " W)~0..3 ")"\nW: "yes" | "no"'))


def test_json_object_on_both_endpoints(api):
    chat = api.chat.completions.create(model="stories260k", messages=MESSAGES, max_tokens=120, temperature=0.0,
                                       response_format={"type": "json_object"}).choices[0]
    completion = api.completions.create(model="stories260k", prompt="The little dog", max_tokens=120, temperature=1.0,
                                        seed=3, extra_body={"response_format": {"type": "json_object"}}).choices[0]
    for text, finish in ((chat.message.content, chat.finish_reason), (completion.text, completion.finish_reason)):
        # any object: this model may not close it within max_tokens; what it finishes parses
        assert isinstance(json.loads(text), dict) if finish == "stop" else text.startswith("{"), text


@pytest.mark.parametrize("extra, param, reason", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}),
     "response_format", "frobnicate"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "JSON Schema"),
    (dict(response_format={"type": "yaml"}), "response_format", "type must be"),
    (dict(guided_regex="a(b"), "guided_regex", "unclosed group"),
    (dict(guided_grammar="start: nowhere"), "guided_grammar", "nowhere"),
    (dict(guided_json="{not json"), "guided_json", "not valid JSON"),
    (dict(guided_choice=[]), "guided_choice", "choice"),
    (dict(guided_regex="a", guided_choice=["a"]), "guided_choice", "not guided_regex and guided_choice"),
    (dict(guided_json={"type": "string", "pattern": "(("}), "guided_json", "regex"),
])
def test_bad_constraints_are_400_with_the_reason(api, extra, param, reason):
    for call in (lambda: api.chat.completions.create(model="stories260k", messages=MESSAGES, max_tokens=8,
                                                     extra_body=extra),
                 lambda: api.completions.create(model="stories260k", prompt="One day", max_tokens=8, extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        err = e.value.body
        assert err["param"] == param and reason in err["message"], err
    ok = api.completions.create(model="stories260k", prompt="One day", max_tokens=4, temperature=0)
    assert ok.choices[0].text


def test_mask_time_is_a_metric(server, api):
    import httpx

    api.completions.create(model="stories260k", prompt="One day", max_tokens=50, temperature=0,
                           extra_body={"guided_choice": ["yes", "no"]})
    import time

    for _ in range(50):   # the engine thread publishes its figures after each step
        text = httpx.get(server.url + "/metrics").text
        values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("jaxinfer_structured_")}
        if values["jaxinfer_structured_masks_total"] >= 1:
            break
        time.sleep(0.02)
    assert values["jaxinfer_structured_masks_total"] >= 1 and values["jaxinfer_structured_mask_seconds_total"] > 0
