"""Sampling: SamplingParams (params.py, validated on the host), batched sampling on the device
(sample.py) and the host's choice of sampler for a step (choose.py)."""

from jaxinfer.sampling.params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

__all__ = ["MAX_LOGPROBS", "SamplingParams", "SamplingParamsError"]
