"""The compiled step variants as typed values.

A `StepVariant` names one jitted step function (phase, sampler, attention, decode steps); with a shape
bucket (tokens of a mixed step, rows of a decode dispatch) it names one executable, a `StepKey`. The
host picks the variant per step from its requests' parameters (`choose_sampler`), so no compiled step
branches on the device (a branch's predicate is read back by the GPU runtime mid-step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxinfer.sampling import SamplingParams

from jaxinfer.sampling.choose import filter_pays, sampler_for

PHASES = ("mixed", "decode", "prompt-logprobs", "verify")
# greedy: argmax only, no top logprobs; branch: one sampling step that skips the sort behind a device-side
# conditional; sort / plain / plain-notop (plain without top logprobs) / filter / filter-p: sampling.sample's
# methods, no conditional.
SAMPLERS = ("greedy", "branch", "sort", "plain", "plain-notop", "filter", "filter-p")
# paged: the paged attention kernel; fresh: one prompt from position 0 on flash attention; prefixed: one
# sequence's chunk after its cached prefix, two flash attentions merged by their log-sum-exps.
# verify: a verify step whose sequences each have Q rows in a [B, Q] layout (ops.verify_attention).
ATTENTIONS = ("paged", "fresh", "prefixed", "verify")


@dataclasses.dataclass(frozen=True, order=True)
class StepVariant:
    phase: str
    sampler: str = "branch"
    attention: str = "paged"
    steps: int = 1             # decode steps per dispatch (decode); rows scored a sequence, Q (verify)
    masked: bool = False       # a mixed or verify step whose batch carries a structured-output bitmask (compiled
                               # on first use)

    def __post_init__(self) -> None:
        if self.phase not in PHASES or self.sampler not in SAMPLERS or self.attention not in ATTENTIONS or \
                self.masked and self.phase not in ("mixed", "prompt-logprobs", "verify"):
            raise ValueError(f"no such step variant: {self}")

    @property
    def greedy(self) -> bool:
        return self.sampler == "greedy"

    @property
    def method(self) -> str:
        """sampling.sample's method."""
        return {"greedy": "branch", "plain-notop": "plain"}.get(self.sampler, self.sampler)

    def n_top(self, max_logprobs: int) -> int:
        """Top logprobs the step computes per sampled row."""
        return 0 if self.sampler in ("greedy", "plain-notop") else max_logprobs

    @property
    def one_sequence(self) -> bool:
        """The step carries one sequence's prompt (and samples its one row)."""
        return self.attention in ("fresh", "prefixed")

    @property
    def name(self) -> str:
        """As in traces and the executable cache: e.g. "decode-greedy-8", "mixed-plain-fresh"."""
        parts = [self.phase] + ([] if self.sampler in ("branch", "sort") else [self.sampler])
        parts += [] if self.attention == "paged" else [self.attention]
        parts += ["masked"] if self.masked else []
        return "-".join(parts + ([str(self.steps)] if self.phase in ("decode", "verify") else []))


@dataclasses.dataclass(frozen=True, order=True)
class StepKey:
    """One executable: a variant at a shape bucket; `part` names a split step's half ("head", "tail")."""

    variant: StepVariant
    bucket: int
    part: str = ""

    @property
    def name(self) -> str:
        return self.variant.name + (f"/{self.part}" if self.part else "")


def choose_sampler(params: Sequence[SamplingParams], rows: int, plain_sampling: bool, decode: bool = False,
                   greedy_step: bool = True) -> str:
    """The sampler for a step over these requests' rows (`rows` sampled): greedy (where the runner has a
    greedy_step) when every row is argmax and wants no top logprobs; with plain_sampling the cheapest method without a conditional
    (sampling.sampler_for; "plain-notop" for a decode dispatch wanting no top logprobs); else "branch"."""
    if greedy_step and all(p.temperature == 0 and not p.logprobs for p in params):
        return "greedy"
    if not plain_sampling:
        return "branch"
    method = sampler_for(params, rows)
    if decode and method == "plain" and not any(p.logprobs for p in params):
        return "plain-notop"
    return method


def samplers_built(plain_sampling: bool, rows: int | None, decode: bool, greedy_step: bool = True) -> list[str]:
    """The samplers a runner compiles for a step of `rows` sampled rows: the filter variants only where
    choose_sampler can pick them."""
    greedy = ["greedy"] * greedy_step
    if not plain_sampling:
        return ["branch"] + greedy
    out = ["sort", "plain"] + ["plain-notop"] * decode + greedy
    return out + [m for m in ("filter", "filter-p") if filter_pays(rows, m)]
