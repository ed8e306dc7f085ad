"""From a validated request to what the engine takes: prompt token ids and SamplingParams per choice.

Checks that need the model live here (the pydantic models check the rest): the model name,
token ids within the vocabulary, the prompt and max_tokens within the context window, and
features this server does not have. Every failure is an APIError with the parameter named.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import SamplingParams, StructuredOutput
from jaxinfer.serve.errors import APIError, bad_request
from jaxinfer.serve.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from jaxinfer.serve.response_format import structured_output
from jaxinfer.serve.tools import HERMES_CLOSE, HERMES_OPEN, ToolUse, tool_use
from jaxinfer.text import ChatTemplate, Tokenizer, TokenizerError


@dataclasses.dataclass
class ModelInfo:
    """What the HTTP layer knows about the model behind it."""

    name: str
    root: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20
    prompt_logprobs: bool = False   # the engine scores prompt tokens (echo with logprobs)
    # SamplingParams fields a request leaves out take these (the model's generation_config.json, as vLLM)
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What /v1/chat/completions renders messages with: the server's --chat-template, else the model's own;
    # None (a base model such as stories260k, and none given): chat requests are answered 400, as vLLM's.
    chat: ChatTemplate | None = None
    # Compiles a structured-output constraint (the engine's grammar compiler), raising a ValueError that says
    # why it cannot; None: constraints are checked when the engine takes the request
    check_structured: Callable[[StructuredOutput], Any] | None = None


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    text: str | None      # as given (completions), for echo


@dataclasses.dataclass
class Prepared:
    """One HTTP request as engine requests: choice index i runs prompts[i // n] with params[i]."""

    prompts: list[Prompt]
    params: list[SamplingParams]
    n: int
    tools: ToolUse | None = None   # a chat request's tools: how its replies' tool calls are parsed

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)


def check_model(req: _Sampling, info: ModelInfo) -> None:
    if req.model is not None and req.model != info.name:
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{info.name}'",
                       param="model", code="model_not_found")


def _check_common(req: _Sampling) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")


def _check_ids(ids: list[int], vocab: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab:
            raise bad_request(f"{param}: token id {t} is outside the vocabulary [0, {vocab})", param=param,
                              code="invalid_value")


def _max_tokens(asked: int | None, default: int | None, prompt_len: int, info: ModelInfo, prompt_param: str,
                tokens_param: str) -> int:
    room = info.max_model_len - prompt_len
    if room < 1:
        raise bad_request(f"this model's maximum context length is {info.max_model_len} tokens; the prompt has "
                          f"{prompt_len} tokens and leaves no room for a completion", param=prompt_param,
                          code="context_length_exceeded")
    if asked is None:
        return room if default is None else min(default, room)
    if asked > room:
        raise bad_request(f"this model's maximum context length is {info.max_model_len} tokens; you asked for "
                          f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} in the completion)",
                          param=tokens_param, code="context_length_exceeded")
    return asked


def _sampling(req: _Sampling, info: ModelInfo, max_tokens: int, logprobs: int | None,
              choice: int, structured: StructuredOutput | None = None) -> SamplingParams:
    kw: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": req.ignore_eos, "logprobs": logprobs,
                          "structured": structured}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        value = info.sampling_defaults.get(name) if value is None else value
        if value is not None:
            kw[name] = value
    if "top_k" in kw:
        kw["top_k"] = min(kw["top_k"], info.vocab_size)      # a k past the vocabulary is no filter
    if req.seed is not None:
        kw["seed"] = req.seed + choice                       # n > 1: distinct but reproducible draws
    if req.stop is not None:
        kw["stop"] = req.stop
    if req.stop_token_ids:
        _check_ids(req.stop_token_ids, info.vocab_size, "stop_token_ids")
        kw["stop_token_ids"] = req.stop_token_ids
    if logprobs is not None and logprobs > info.max_logprobs:
        raise bad_request(f"logprobs: at most {info.max_logprobs} are served", param="logprobs")
    try:
        return SamplingParams(**kw)
    except (JaxinferError, ValueError) as e:
        field = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=field if field in kw else None, code="invalid_value") from e


def prepare_completion(req: CompletionRequest, info: ModelInfo) -> Prepared:
    check_model(req, info)
    _check_common(req)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", param="best_of", code="unsupported_parameter")
    if req.echo and req.logprobs is not None and not info.prompt_logprobs:
        raise bad_request("echo with logprobs needs prompt logprobs: start the server with --enable-prompt-logprobs",
                          param="echo", code="unsupported_parameter")
    if req.echo and req.logprobs is not None and req.stream:
        raise bad_request("echo with logprobs is not supported when streaming", param="echo",
                          code="unsupported_parameter")
    p = req.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif p and isinstance(p[0], int):
        raw = [p]  # type: ignore[list-item]
    else:
        raw = list(p)  # type: ignore[arg-type]
    if not raw:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(raw) * req.n > 1024:
        raise bad_request("too many prompts x n in one request (at most 1024)", param="prompt")
    prompts = []
    for item in raw:
        if isinstance(item, str):
            ids = info.tokenizer.encode(item)
        else:
            ids = list(item)
            _check_ids(ids, info.vocab_size, "prompt")
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        prompts.append(Prompt(ids, item if isinstance(item, str) else None))
    params = []
    structured = structured_output(req, info.check_structured)
    for q in prompts:
        max_tokens = _max_tokens(req.max_tokens, info.sampling_defaults.get("max_tokens", 16), len(q.ids), info,
                                 "prompt", "max_tokens")
        params += [_sampling(req, info, max_tokens, req.logprobs, i, structured) for i in range(req.n)]
    if req.echo and req.logprobs is not None:
        params = [dataclasses.replace(sp, prompt_logprobs=req.logprobs) for sp in params]
    return Prepared(prompts, params, req.n)


def _message_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text":
                    raise bad_request(f"messages[{i}].content: parts of type '{part.type}' are not supported",
                                      param=f"messages[{i}].content", code="unsupported_content")
                texts.append(part.text)
            content = "".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [_with_argument_dict(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _with_argument_dict(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier tool call as chat templates take it: OpenAI sends its arguments as JSON text, the templates (as
    transformers') want the object."""
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass
    return call


def chat_prompt_text(req: ChatCompletionRequest, info: ModelInfo) -> str:
    """The conversation rendered by the chat template, as prompt text (tokenized without adding
    special tokens: templates write BOS themselves)."""
    if info.chat is None:
        raise bad_request("this model has no chat template: start the server with --chat-template FILE, or send "
                          "the prompt text to /v1/completions", param="messages", code="chat_template_missing")
    messages = _message_dicts(req)
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        return info.chat.render(messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools or None,
                                **kwargs)
    except TokenizerError as e:
        raise bad_request(str(e), param="messages", code="chat_template_error") from e
    except Exception as e:  # a template may raise anything on odd input; it is still the input's fault
        raise bad_request(f"chat template error: {type(e).__name__}: {e}", param="messages",
                          code="chat_template_error") from e


def prepare_chat(req: ChatCompletionRequest, info: ModelInfo) -> Prepared:
    check_model(req, info)
    _check_common(req)
    structured = structured_output(req, info.check_structured)
    template = "" if info.chat is None else "".join(info.chat.templates.values())
    markers = tuple(info.tokenizer.token_to_id(t) for t in (HERMES_OPEN, HERMES_CLOSE))
    tools, call = tool_use(req.tools, req.tool_choice, template, markers)
    if call is not None:   # a required or named call: its grammar
        if structured is not None:
            raise bad_request("give a structured-output constraint or a required tool call, not both",
                              param="tool_choice", code="invalid_value")
        try:
            if info.check_structured is not None:
                info.check_structured(call)
        except (JaxinferError, ValueError) as e:
            raise bad_request(f"tools: a function's parameters do not compile: {e}", param="tools",
                              code="invalid_value") from e
        structured = call
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("give max_completion_tokens or max_tokens, not both", param="max_tokens")
    ids = info.tokenizer.encode(chat_prompt_text(req, info), add_special_tokens=False)
    if not ids:
        raise bad_request("messages: the conversation is empty", param="messages")
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(asked, info.sampling_defaults.get("max_tokens"), len(ids), info, "messages", param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = [_sampling(req, info, max_tokens, logprobs, i, structured) for i in range(req.n)]
    return Prepared([Prompt(ids, None)], params, req.n, tools)
