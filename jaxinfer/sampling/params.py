"""SamplingParams: what one request asks of the sampler, validated on the host.

`__post_init__` checks every field and raises `SamplingParamsError` (a `ValueError`) whose message
starts with the field's name; numeric fields are normalised to int/float, stop lists to fresh lists.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers

import numpy as np

from jaxinfer.errors import JaxinferError

MAX_LOGPROBS = 20
_U32_MASK = 0xFFFFFFFF


class SamplingParamsError(JaxinferError, ValueError):
    """An invalid sampling parameter; the message starts with the field's name."""


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def check_int(name: str, x) -> int:
    if not is_int(x):
        raise SamplingParamsError(f"{name} must be an int, got {x!r} ({type(x).__name__})")
    return int(x)


def _check_float(name: str, x) -> float:
    if not _is_real(x):
        raise SamplingParamsError(f"{name} must be a number, got {x!r} ({type(x).__name__})")
    x = float(x)
    if not math.isfinite(x):
        raise SamplingParamsError(f"{name} must be finite, got {x!r}")
    return x


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output (vLLM's guided decoding): exactly one of

    - ``json``: a JSON Schema (a dict, or its JSON text); the output is one JSON value that validates;
    - ``json_object=True``: any JSON object;
    - ``regex``: the output matches the regular expression (Rust ``regex`` syntax, anchored at both ends);
    - ``choice``: the output is one of these strings;
    - ``grammar``: a context-free grammar, Lark (llguidance's dialect) or GBNF/EBNF (llama.cpp's).

    Hashable (``json`` is kept as canonical JSON text), so compiled grammars are cached by it. Whether a
    schema, regex or grammar compiles is checked against the tokenizer when the request is added
    (sampling.structured); here only the shape of the fields.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(f"structured must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                                      f"got {', '.join(given) or 'none'}")
        if not isinstance(self.json_object, (bool, np.bool_)):
            raise SamplingParamsError(f"structured.json_object must be a bool, got {self.json_object!r}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise SamplingParamsError(f"structured.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise SamplingParamsError(f"structured.json must be a JSON Schema (an object), got "
                                          f"{type(schema).__name__}")
            object.__setattr__(self, "json", json.dumps(schema, sort_keys=True))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise SamplingParamsError(f"structured.{name} must be a non-empty str, got {v!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamsError(f"structured.choice must be a non-empty list of non-empty str, "
                                          f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of STRUCTURED_KINDS."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclasses.dataclass
class SamplingParams:
    """What one request asks of the sampler; validated on construction.

    ``stop`` and ``stop_token_ids`` are normalised to (fresh) lists, ``[]`` when not given.
    Numeric fields are normalised to ``int``/``float``.
    """

    max_tokens: int = 16  # >= 1
    temperature: float = 1.0  # >= 0; 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = -1  # -1 or 0 = off, else >= 1
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0; prompt + generated tokens
    presence_penalty: float = 0.0  # [-2, 2]; generated tokens
    frequency_penalty: float = 0.0  # [-2, 2]; generated tokens
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return; 0..20
    prompt_logprobs: int | None = None  # logprob of each prompt token (and this many top ones); 0..20
    n: int = 1  # completions of the prompt (LLM.generate's outputs list); a seeded request's i-th uses seed + i
    structured: StructuredOutput | None = None  # a JSON schema, regex, choice or grammar the output must follow

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits (apply_penalties leaves them as they are otherwise)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def __post_init__(self) -> None:
        self.max_tokens = check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.n = check_int("n", self.n)
        if self.n < 1:
            raise SamplingParamsError(f"n must be >= 1, got {self.n}")

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")

        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")

        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")

        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        for name in ("presence_penalty", "frequency_penalty"):
            v = _check_float(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {v}")
            setattr(self, name, v)

        if self.seed is not None:
            self.seed = check_int("seed", self.seed)

        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise SamplingParamsError(f"stop must be a str, a list of str or None, got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str):
                raise SamplingParamsError(f"stop must contain only str, got {s!r} ({type(s).__name__})")
            if not s:
                raise SamplingParamsError("stop must not contain empty strings")
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (list, tuple)):
            ids = list(ids)
        else:
            raise SamplingParamsError(f"stop_token_ids must be a list of int or None, got {type(ids).__name__}")
        for i in ids:
            if not is_int(i):
                raise SamplingParamsError(f"stop_token_ids must contain only int, got {i!r} ({type(i).__name__})")
            if i < 0:
                raise SamplingParamsError(f"stop_token_ids must be >= 0, got {i}")
        self.stop_token_ids = [int(i) for i in ids]

        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise SamplingParamsError(f"ignore_eos must be a bool, got {self.ignore_eos!r} ({type(self.ignore_eos).__name__})")
        self.ignore_eos = bool(self.ignore_eos)

        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                v = check_int(name, v)
                if not 0 <= v <= MAX_LOGPROBS:
                    raise SamplingParamsError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
                setattr(self, name, v)

        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise SamplingParamsError(f"structured must be a StructuredOutput or None, got "
                                      f"{type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature == 0)."""
        return self.temperature == 0.0


def seed_to_u32(seed: int) -> int:
    """The device seed for a host int: its low 32 bits (negative ints in two's complement)."""
    return int(seed) & _U32_MASK
