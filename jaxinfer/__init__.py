"""jaxinfer: LLM inference in JAX."""

from jaxinfer.sampling.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in the whole engine; import it lazily so `import jaxinfer.model.config` stays light.
    if name == "LLM":
        from jaxinfer.engine.engine import LLM

        return LLM
    raise AttributeError(name)
