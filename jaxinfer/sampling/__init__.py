"""Sampling: SamplingParams (validated on the host) and batched sampling on the device."""

from jaxinfer.sampling.sampling import SamplingParams, SamplingParamsError

__all__ = ["SamplingParams", "SamplingParamsError"]
