"""What the engine returns: per request a RequestOutput holding one CompletionOutput per sample (vLLM's
shape: `out.outputs[0].text`), and while it runs a StreamDelta per step that added to it."""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.scheduler import Sequence


@dataclasses.dataclass
class CompletionOutput:
    """One generated sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]                                   # of each generated token
    finish_reason: str | None                               # "stop" | "length" | "abort" | None while running
    top_logprobs: list[list[tuple[int, float]]] | None = None   # per token [(id, logprob)], when asked for

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None   # per prompt token: None (the first), else (logprob, top list)


@dataclasses.dataclass
class StreamDelta:
    """What one engine step added to one request."""

    request_id: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None   # per new token, when params.logprobs asked


def completion_of(seq: Sequence, index: int = 0) -> CompletionOutput:
    return CompletionOutput(index, seq.text, list(seq.output_ids), list(seq.logprobs), seq.finish_reason,
                            list(seq.top_logprobs) if seq.params.logprobs is not None else None)


def output_of(seq: Sequence) -> RequestOutput:
    return RequestOutput(seq.request_id, seq.prompt, seq.prompt_ids, [completion_of(seq)],
                         seq.finish_reason is not None,
                         list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None)
