"""The OpenAI protocol as pydantic models: requests (validated) and responses (documented).

Requests are strict: a string where a number belongs is an error (400), as with OpenAI, not a
value to coerce. Ranges that do not depend on the model are checked here; the rest (context
length, token ids within the vocabulary) in `params.py`. Fields beyond OpenAI's, as vLLM names
them: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, guided_json / regex / choice / grammar.

Responses are built as plain dicts for speed (see `responses.py`); the response models here
exist for the OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxinfer.sampling import MAX_LOGPROBS   # top logprobs per token (OpenAI: 20 for chat, 5 for completions)

MAX_N = 128           # OpenAI's limit on choices per request
MAX_STOP = 16         # stop strings per request


def _bad_text(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate(obj: Any, path: str = "") -> str | None:
    """Where a string holds an unpaired surrogate (JSON allows the escape "\\ud800"; UTF-8 does not).

    Runs on every request body before validation: numbers are skipped without building their path (a
    long prompt of token ids would otherwise build one per element)."""
    if isinstance(obj, str):
        return (path or "body") if _bad_text(obj) else None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str) and _bad_text(k):
                return path or "body"
            if isinstance(v, (str, dict, list)) and (bad := _lone_surrogate(v, f"{path}.{k}" if path else str(k))):
                return bad
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, str):
                if _bad_text(v):
                    return f"{path}[{i}]"
            elif isinstance(v, (dict, list)) and (bad := _lone_surrogate(v, f"{path}[{i}]")):
                return bad
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class _Request(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        bad = _lone_surrogate(data)
        if bad:
            raise ValueError(f"{bad}: text must be valid Unicode (an unpaired surrogate escape was found)")
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="the served model name (see /v1/models); default: the only one")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=1e4, description="0 is greedy; default: the model's generation_config.json, else 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=1e4)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted so that clients sending them get a clear answer; anything but the default is refused.
    logit_bias: dict[str, float] | None = None
    # Structured output (serve/response_format.py): OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': "
        "{'name', 'schema', 'strict'}}")
    guided_json: dict[str, Any] | str | None = Field(None, description="the output follows this JSON Schema")
    guided_regex: str | None = Field(None, description="the output matches this regular expression")
    guided_choice: list[str] | None = Field(None, description="the output is one of these strings")
    guided_grammar: str | None = Field(None, description="the output follows this grammar (Lark or GBNF)")


class CompletionRequest(_Sampling):
    # token ids first: a union is tried in order, and a long list of ids is the common case for clients
    # that tokenize themselves
    prompt: list[int] | str | list[str] | list[list[int]] = Field(
        ..., description="a string, a list of strings, a list of token ids, or a list of lists of token ids")
    max_tokens: int | None = Field(16, ge=1, description="default 16, as OpenAI")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url", "input_audio", "file", "refusal"]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant's earlier calls (serve/tools.py)
    tool_call_id: str | None = None                  # a tool's answer: to which call


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: what is left of the context")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra template variables, e.g. "
                                                        "{\"enable_thinking\": false}")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


# ---------------------------------------------------------------------------- responses (schema)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxinfer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
