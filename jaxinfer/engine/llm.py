"""LLM, the offline API (`LLM(model).generate(prompts, SamplingParams(...))`, vLLM's shape), and `stream`,
one request's text as it is produced."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from jaxinfer.engine.engine import Engine
from jaxinfer.engine.outputs import RequestOutput, StreamDelta
from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import SamplingParams


class LLM:
    """Offline generation. Settings are EngineConfig's (jaxinfer/settings.py): `LLM(model, dtype="bfloat16")`.
    Steps compile on first use, so a script's first prompt starts quickly."""

    def __init__(self, model: str | Path, **settings):
        self.engine = Engine(model, **settings)
        self.tokenizer = self.engine.tokenizer
        if self.engine.config.progress:
            print(self.engine.summary, file=sys.stderr)

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; each holds `params.n` completions (`.outputs`). Prompts are
        strings or token id lists. Without sampling_params, the model's generation defaults."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        params = [p or self.engine.default_sampling_params() for p in params]
        ids: list[list[int]] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append([self.engine.add_request(prompt, sample) for sample in _samples(p)])
        except (JaxinferError, ValueError):
            for i in (i for group in ids for i in group):
                self.engine.abort(i)
            raise
        while self.engine.has_unfinished():
            self.engine.step()
        return [_merged([self.engine.take_finished(i) for i in group]) for group in ids]


def _samples(params: SamplingParams) -> list[SamplingParams]:
    """A request's n samples as n requests: a seeded request's i-th sample is seeded seed + i."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


def _merged(outs: list[RequestOutput]) -> RequestOutput:
    first = outs[0]
    completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    return dataclasses.replace(first, outputs=completions, finished=all(o.finished for o in outs))


def stream(engine: Engine, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterable[StreamDelta]:
    """Generate one request alone, yielding its text as it is produced."""
    rid = engine.add_request(prompt, params)
    while True:
        for delta in engine.step():
            if delta.request_id == rid:
                yield delta
                if delta.finished:
                    engine.take_finished(rid)
                    return
