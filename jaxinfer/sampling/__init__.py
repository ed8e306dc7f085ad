"""Sampling: SamplingParams (params.py, validated on the host), batched sampling on the device
(sample.py), the host's choice of sampler for a step (choose.py) and structured output's grammars
(structured.py)."""

from jaxinfer.sampling.params import MAX_LOGPROBS, SamplingParams, SamplingParamsError, StructuredOutput

__all__ = ["MAX_LOGPROBS", "SamplingParams", "SamplingParamsError", "StructuredOutput"]
