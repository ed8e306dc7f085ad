"""POST /v1/chat/completions: messages through the model's chat template, n choices."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxinfer.serve.async_engine import Event, Group
from jaxinfer.serve.logprobs import chat_logprobs
from jaxinfer.serve.params import prepare_chat
from jaxinfer.serve.protocol import ChatCompletionRequest
from jaxinfer.serve.metrics import handler_start
from jaxinfer.serve.state import ServerState
from jaxinfer.serve.streaming import (choice_chunks, chunk_maker, event_stream, final_events, new_id, now,
                                      off_loop, usage)
from jaxinfer.serve.tools import held_back, parse_tool_calls


async def create_chat_completion(req: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    arrived = handler_start(request, state.metrics)
    prep = await off_loop(prepare_chat, req, state.info)
    ids = prep.prompts[0].ids
    group = await state.engine.submit([ids] * prep.n, prep.params, arrived)
    rid, created, model = new_id("chatcmpl"), now(), state.info.name
    want_logprobs = bool(req.logprobs)
    k = req.top_logprobs or 0
    tt = state.token_text

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk = chunk_maker({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "system_fingerprint": None}, include_usage)

        use = prep.tools if prep.tools is not None and prep.tools.parse else None
        texts, sent = [""] * prep.n, [0] * prep.n   # with tools: each reply so far, and how much of it went out

        def choice_of(ev: Event) -> dict[str, Any] | None:
            d = ev.delta
            lp = None
            if want_logprobs and d.token_ids:
                lp = {"content": chat_logprobs(tt, d.token_ids, d.logprobs, d.top_logprobs, k), "refusal": None}
            delta: dict[str, Any] = {"content": d.text} if d.text else {}
            finish = d.finish_reason
            if use is not None:   # text that may be a tool call waits for the end of the reply
                i = ev.index
                texts[i] += d.text
                upto = held_back(texts[i], use) if not d.finished else len(texts[i])
                delta = {"content": texts[i][sent[i]:upto]} if upto > sent[i] else {}
                if d.finished:
                    content, calls = parse_tool_calls(texts[i], use)
                    if calls:
                        rest = (content or "")[sent[i]:] if (content or "").startswith(texts[i][:sent[i]]) else ""
                        delta = {"content": rest} if rest else {}
                        delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls)]
                        finish = "tool_calls"
                sent[i] = max(sent[i], upto)
            if not delta and lp is None and not d.finished:
                return None
            return {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

        async def body(g: Group) -> AsyncIterator[bytes]:
            for i in range(prep.n):   # the role first, as OpenAI sends it, before any token
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for b in choice_chunks(g, choice_of, chunk, include_usage, prep.num_prompt_tokens):
                yield b

        return event_stream(group, body)

    finals = await final_events(group, request)
    if isinstance(finals, Response):
        return finals
    choices, completion_tokens = [], 0
    for ev in finals:
        out = ev.output.outputs[0]
        completion_tokens += len(out.token_ids)
        lp = None
        if want_logprobs:
            lp = {"content": chat_logprobs(tt, out.token_ids, out.logprobs, out.top_logprobs, k),
                  "refusal": None}
        message = {"role": "assistant", "content": out.text, "refusal": None}
        finish = out.finish_reason
        if prep.tools is not None:
            message["content"], calls = parse_tool_calls(out.text, prep.tools)
            if calls:
                message["tool_calls"], finish = calls, "tool_calls"
        choices.append({"index": ev.index, "message": message, "logprobs": lp, "finish_reason": finish})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": usage(prep.num_prompt_tokens, completion_tokens),
                         "system_fingerprint": None})
