"""The sampling defaults a model's generation_config.json asks for, applied as vLLM applies them.

vLLM (`--generation-config auto`, its default) fills the sampling parameters a request leaves out
from the model's generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as max_tokens. Qwen3, for one, ships temperature 0.6, top_k 20, top_p 0.95. Like vLLM,
`do_sample` is not consulted. A request that gives a value keeps it; `SamplingParams` built by hand
are used as they are (only a request without any params gets these defaults).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxinfer.model.config import read_json
from jaxinfer.errors import ModelLoadError
from jaxinfer.sampling import SamplingParams

# generation_config.json key -> SamplingParams field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_defaults(source: str | Path | None, model_dir: str | Path) -> dict[str, Any]:
    """The SamplingParams fields to default, from `source`: "auto" (the model folder's
    generation_config.json, if it has one), "none" or None (no defaults: the library's), or a folder
    holding a generation_config.json. Values are checked as SamplingParams checks them; a bad one raises
    ModelLoadError naming the file and the key."""
    if source is None or source == "none":
        return {}
    folder = Path(model_dir) if source == "auto" else Path(source)
    path = folder / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}
        raise ModelLoadError(f"--generation-config {source}: {path} not found")
    config = read_json(path)
    out = {}
    for key, field in FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ModelLoadError(f"{path}: {key} must be a number, got {value!r}")
        out[field] = value
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return out


def describe(defaults: dict[str, Any]) -> str:
    """One line for the start-up log: "temperature 0.6, top_k 20, top_p 0.95"."""
    return ", ".join(f"{k} {v}" for k, v in defaults.items())
