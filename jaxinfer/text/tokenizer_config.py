"""A Hugging Face tokenizer folder's JSON files: tokenizer_config.json (merged with the legacy
special_tokens_map.json), and the special tokens it names, read the way transformers reads them."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer folder or file that cannot be loaded; the message names the path."""


def read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise TokenizerError(f"missing file: {path}")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read JSON from {path}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"expected a JSON object in {path}, got {type(data).__name__}")
    return data


def token_content(value: Any) -> str | None:
    """A special token in a config is a string or an AddedToken dict ({"content": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def resolve_dir(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        raise TokenizerError(f"tokenizer folder not found: {p}")
    if not p.is_dir():
        raise TokenizerError(f"not a folder: {p}")
    return p


def load_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json (optional), merged with the legacy special_tokens_map.json the way
    transformers does: only when the config has no added_tokens_decoder, and the map wins."""
    config = read_json(folder / CONFIG_FILE, required=False) or {}
    if "added_tokens_decoder" not in config:
        legacy = read_json(folder / SPECIAL_TOKENS_MAP_FILE, required=False) or {}
        for key, value in legacy.items():
            if key.endswith("_token"):
                config[key] = value
    return config


def special_tokens_map(config: Mapping[str, Any]) -> dict[str, str]:
    """transformers' `special_tokens_map`: the named tokens plus any model-specific `*_token` string
    entries of the config (v5 treats those as extra named tokens), as plain strings."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if key in _NAMED_SPECIAL_TOKENS:
            if (content := token_content(value)) is not None:
                out[key] = content
        elif isinstance(value, str):
            out[key] = value
    return out
