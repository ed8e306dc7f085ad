"""POST /v1/completions: prompts (text or token ids, one or a batch) x n choices."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxinfer.serve.async_engine import Event
from jaxinfer.serve.logprobs import completion_logprobs
from jaxinfer.serve.params import prepare_completion
from jaxinfer.serve.protocol import CompletionRequest
from jaxinfer.serve.metrics import handler_start
from jaxinfer.serve.state import ServerState
from jaxinfer.serve.streaming import (choice_chunks, chunk_maker, event_stream, final_events, new_id, now,
                                      off_loop, usage)


async def create_completion(req: CompletionRequest, request: Request, state: ServerState) -> Response:
    arrived = handler_start(request, state.metrics)
    prep = await off_loop(prepare_completion, req, state.info)
    n = prep.n
    choice_prompts = [prep.prompts[i // n] for i in range(len(prep.params))]
    group = await state.engine.submit([p.ids for p in choice_prompts], prep.params, arrived)
    rid, created, model = new_id("cmpl"), now(), state.info.name
    k = req.logprobs
    tt = state.token_text

    def echo_text(i: int) -> str:
        p = choice_prompts[i]
        return p.text if p.text is not None else state.info.tokenizer.decode(p.ids)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk = chunk_maker({"id": rid, "object": "text_completion", "created": created, "model": model},
                            include_usage)
        echoed = [not req.echo] * len(choice_prompts)
        offsets = [0] * len(choice_prompts)

        def choice_of(ev: Event) -> dict[str, Any] | None:
            d, i = ev.delta, ev.index
            text = d.text
            if not echoed[i]:
                text, echoed[i] = echo_text(i) + text, True
            lp = None
            if k is not None and d.token_ids:
                lp = completion_logprobs(tt, d.token_ids, d.logprobs, d.top_logprobs, k, offsets[i])
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else offsets[i]
            if not text and lp is None and not d.finished:
                return None
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}

        return event_stream(group, lambda g: choice_chunks(g, choice_of, chunk, include_usage, prep.num_prompt_tokens))

    finals = await final_events(group, request)
    if isinstance(finals, Response):
        return finals
    choices, completion_tokens = [], 0
    for ev in finals:
        out = ev.output.outputs[0]
        completion_tokens += len(out.token_ids)
        prefix = echo_text(ev.index) if req.echo else ""
        lp = None
        if k is not None:
            lp = completion_logprobs(tt, out.token_ids, out.logprobs, out.top_logprobs, k,
                                     len(prefix))
            if req.echo:
                lp = _with_prompt(tt, ev.output.prompt_token_ids, ev.output.prompt_logprobs, k, lp)
        choices.append({"index": ev.index, "text": prefix + out.text, "logprobs": lp,
                        "finish_reason": out.finish_reason})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": usage(prep.num_prompt_tokens, completion_tokens),
                         "system_fingerprint": None})


def _with_prompt(tt, prompt_ids: list[int], prompt_logprobs: list, k: int, lp: dict[str, Any]) -> dict[str, Any]:
    """Completion logprobs preceded by the prompt's (echo): the first prompt token has none, as in OpenAI."""
    first = tt(prompt_ids[0])[0]
    scored = prompt_logprobs[1:]
    rest = completion_logprobs(tt, prompt_ids[1:], [v for v, _ in scored], [top for _, top in scored], k, len(first))
    return {"tokens": [first] + rest["tokens"] + lp["tokens"],
            "token_logprobs": [None] + rest["token_logprobs"] + lp["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"] + lp["top_logprobs"],
            "text_offset": [0] + rest["text_offset"] + lp["text_offset"]}
