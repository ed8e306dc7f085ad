"""The tokenizer: a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json,
generation_config.json) behaving like transformers' AutoTokenizer.

Encoding and decoding go through the Rust `tokenizers` library. The reference is transformers 5.x
`AutoTokenizer`; tests/data/golden/tokenizers.json pins its outputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _RustTokenizer

from jaxinfer.text.chat_template import ChatTemplate
from jaxinfer.text.tokenizer_config import (
    GENERATION_CONFIG_FILE,
    TOKENIZER_FILE,
    TokenizerError,
    load_config,
    read_json,
    resolve_dir,
    special_tokens_map,
    token_content,
)


def _llama_pipeline(tok_json: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5 rebuilds LlamaTokenizer's pipeline instead of using tokenizer.json's: no
    normalizer, a Metaspace pre-tokenizer (which, unlike the legacy Prepend normalizer, does not
    add a second "▁" to text that already starts with a space), and a BPE model without unk.
    Mirror that so encode() matches AutoTokenizer."""
    if tok_json.get("model", {}).get("type") != "BPE":
        return tok_json
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    legacy = bool(config.get("legacy", False))
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_prefix_space:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    model = dict(tok_json["model"])
    model.update(unk_token=None, fuse_unk=True, byte_fallback=True, dropout=None,
                 continuing_subword_prefix=None, end_of_word_suffix=None, ignore_merges=False)
    return {
        **tok_json,
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": False},
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": model,
    }


def clean_up_tokenization(text: str) -> str:
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
            .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
            .replace(" 've", "'ve").replace(" 're", "'re"))


class Tokenizer:
    """A Hugging Face tokenizer folder: tokenizer.json + tokenizer_config.json
    (+ generation_config.json), behaving like transformers' AutoTokenizer."""

    def __init__(self, backend: _RustTokenizer, config: Mapping[str, Any] | None = None,
                 generation_config: Mapping[str, Any] | None = None, chat: ChatTemplate | None = None) -> None:
        self._tok = backend
        self.config: dict[str, Any] = dict(config or {})
        self.generation_config: dict[str, Any] = dict(generation_config or {})
        self.chat = chat if chat is not None else ChatTemplate(None, special_tokens_map(self.config))
        self._add_missing_special_tokens()
        # transformers skips its clean-up for BPE models (it corrupts their output); others honour it.
        self._clean_up = bool(self.config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE"
        )
        self.bos_token: str | None = token_content(self.config.get("bos_token"))
        self.eos_token: str | None = token_content(self.config.get("eos_token"))
        self.pad_token: str | None = token_content(self.config.get("pad_token"))
        # Informational: transformers 5 ignores these flags when tokenizer.json exists (its
        # post_processor decides whether BOS/EOS are added), and so do we.
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.add_eos_token = bool(self.config.get("add_eos_token", False))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        folder = resolve_dir(path)
        tok_file = folder / TOKENIZER_FILE
        if not tok_file.is_file():
            raise TokenizerError(f"missing file: {tok_file}")
        config = load_config(folder)
        generation_config = read_json(folder / GENERATION_CONFIG_FILE, required=False)
        try:
            if config.get("tokenizer_class") in ("LlamaTokenizer", "LlamaTokenizerFast"):
                tok_json = json.loads(tok_file.read_text(encoding="utf-8"))
                backend = _RustTokenizer.from_str(json.dumps(_llama_pipeline(tok_json, config)))
            else:
                backend = _RustTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception for bad files
            raise TokenizerError(f"cannot load {tok_file}: {e}") from e
        chat = ChatTemplate.from_folder(folder, config)
        return cls(backend, config, generation_config, chat)

    def _add_missing_special_tokens(self) -> None:
        """Tokens the config declares but tokenizer.json lacks are added, as transformers does."""
        to_add: list[AddedToken] = []
        decoder = self.config.get("added_tokens_decoder") or {}
        for spec in decoder.values():
            if isinstance(spec, Mapping) and self._tok.token_to_id(spec.get("content", "")) is None:
                fields = {k: spec[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in spec}
                to_add.append(AddedToken(spec["content"], **fields))
        extra = self.config.get("additional_special_tokens") or self.config.get("extra_special_tokens") or []
        names = [*special_tokens_map(self.config).values(), *(token_content(t) for t in extra)]
        for name in names:
            if name and self._tok.token_to_id(name) is None and all(t.content != name for t in to_add):
                to_add.append(AddedToken(name, special=True, normalized=False))
        if to_add:
            self._tok.add_tokens(to_add)

    # -- properties

    @property
    def backend(self) -> _RustTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def cleans_up_spaces(self) -> bool:
        """Whether decode() applies transformers' clean_up_tokenization to the text."""
        return self._clean_up

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (transformers' len(tokenizer);
        its `vocab_size` attribute leaves added tokens out)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self._tok.token_to_id(self.pad_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's eos plus generation_config.json's eos_token_id (an int or a list)."""
        ids: list[int] = []
        if self.eos_token is not None and (i := self._tok.token_to_id(self.eos_token)) is not None:
            ids.append(i)
        gen = self.generation_config.get("eos_token_id")
        for i in gen if isinstance(gen, list) else [gen]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
        return tuple(ids)

    @property
    def chat_template(self) -> str | None:
        return self.chat.default

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self.chat.special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # -- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up else text

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """Render `messages` to the prompt text (tokenize it with encode(text, add_special_tokens=False),
        as transformers does, since templates write BOS themselves)."""
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                **template_kwargs)
