"""jaxinfer: LLM inference in JAX."""

from importlib.metadata import PackageNotFoundError, version

from jaxinfer.sampling import SamplingParams

try:
    __version__ = version("jaxinfer")
except PackageNotFoundError:   # run from a checkout without installing
    __version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in the whole engine; import it lazily so `import jaxinfer.model.config` stays light.
    if name == "LLM":
        from jaxinfer.engine.llm import LLM

        return LLM
    raise AttributeError(name)
