"""Tokenizer, chat templates, incremental detokenization and stop strings.

Encoding and decoding go through the Rust `tokenizers` library; chat templates are rendered with
jinja2 exactly the way Hugging Face transformers' `apply_chat_template` does. The reference is
transformers 5.x `AutoTokenizer`; tests/data/golden/tokenizers.json pins its outputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _RustTokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "Tokenizer",
    "TokenizerError",
]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

_REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer folder or file that cannot be loaded; the message names the path."""


class ChatTemplateError(TokenizerError):
    """A chat template that is missing, does not compile, or raised while rendering."""


# ----------------------------------------------------------------------------- file helpers


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
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


def _token_content(value: Any) -> str | None:
    """A special token in a config is a string or an AddedToken dict ({"content": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _resolve_dir(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        raise TokenizerError(f"tokenizer folder not found: {p}")
    if not p.is_dir():
        raise TokenizerError(f"not a folder: {p}")
    return p


def _load_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json (optional), merged with the legacy special_tokens_map.json the way
    transformers does: only when the config has no added_tokens_decoder, and the map wins."""
    config = _read_json(folder / CONFIG_FILE, required=False) or {}
    if "added_tokens_decoder" not in config:
        legacy = _read_json(folder / SPECIAL_TOKENS_MAP_FILE, required=False) or {}
        for key, value in legacy.items():
            if key.endswith("_token"):
                config[key] = value
    return config


# ----------------------------------------------------------------------------- chat templates


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` blocks (they only mark the
    assistant tokens for training masks); the body renders unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers replaces jinja's tojson: no HTML escaping, non-ASCII kept, options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


class ChatTemplate:
    """One or more named Jinja chat templates plus the special tokens they are rendered with.

    Needs no vocabulary, so a folder holding only tokenizer_config.json (like llama3/) works.
    """

    def __init__(self, templates: Mapping[str, str] | str | None, special_tokens: Mapping[str, str] | None = None,
                 source: str = "<memory>") -> None:
        if isinstance(templates, str):
            templates = {"default": templates}
        self.templates: dict[str, str] = dict(templates or {})
        # bos_token, eos_token, ... as strings: every template gets them as variables.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.source = source

    @classmethod
    def from_tokenizer_config(cls, path: str | os.PathLike[str]) -> ChatTemplate:
        """Load from a folder (or its tokenizer_config.json). Raises ChatTemplateError if the folder
        has no chat template at all."""
        p = Path(path)
        folder = p.parent if p.is_file() else _resolve_dir(p)
        chat = cls._from_folder(folder, _load_config(folder))
        if not chat.templates:
            raise ChatTemplateError(f"no chat template in {folder} ({CONFIG_FILE} or {CHAT_TEMPLATE_FILE})")
        return chat

    @classmethod
    def _from_folder(cls, folder: Path, config: Mapping[str, Any]) -> ChatTemplate:
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
            try:
                templates = {t["name"]: t["template"] for t in raw}
            except (KeyError, TypeError) as e:
                raise TokenizerError(f"bad chat_template list in {folder / CONFIG_FILE}") from e
        elif isinstance(raw, dict):
            templates = dict(raw)
        elif raw is not None:
            raise TokenizerError(f"bad chat_template in {folder / CONFIG_FILE}: {type(raw).__name__}")
        # Separate template files take priority over the config's entries (as in transformers).
        files: dict[str, str] = {}
        try:
            if (folder / CHAT_TEMPLATE_FILE).is_file():
                files["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
            if (folder / CHAT_TEMPLATE_DIR).is_dir():
                for f in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja")):
                    files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read chat template in {folder}: {e}") from e
        if files:
            templates = files
        return cls(templates, _special_tokens_map(config), source=str(folder))

    @property
    def default(self) -> str | None:
        return self.templates.get("default")

    def select(self, name: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template source to use, by transformers' rules: a name (or a literal template),
        else "tool_use" when tools are given and it exists, else "default"."""
        if name is not None:
            return self.templates.get(name, name)
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if not self.templates:
            raise ChatTemplateError(f"no chat template for {self.source}")
        raise ChatTemplateError(
            f"several chat templates and no default in {self.source}: pick one of {sorted(self.templates)}"
        )

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, documents: Sequence[Mapping[str, Any]] | None = None,
               chat_template: str | None = None, **template_kwargs: Any) -> str:
        """Render one conversation. Extra keyword arguments (e.g. enable_thinking=False) become
        template variables and override the special tokens of the same name."""
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, Mapping):
                    raise ChatTemplateError(f"tools must be JSON schemas (dicts), got {type(tool).__name__}")
            tools = list(tools)
        template = _compile(self.select(chat_template, tools))
        try:
            return template.render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **template_kwargs},
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e


def _special_tokens_map(config: Mapping[str, Any]) -> dict[str, str]:
    """transformers' `special_tokens_map`: the named tokens plus any model-specific `*_token` string
    entries of the config (v5 treats those as extra named tokens), as plain strings."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if key in _NAMED_SPECIAL_TOKENS:
            if (content := _token_content(value)) is not None:
                out[key] = content
        elif isinstance(value, str):
            out[key] = value
    return out


# ----------------------------------------------------------------------------- tokenizer


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


def _clean_up_tokenization(text: str) -> str:
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
        self.chat = chat if chat is not None else ChatTemplate(None, _special_tokens_map(self.config))
        self._add_missing_special_tokens()
        # transformers skips its clean-up for BPE models (it corrupts their output); others honour it.
        self._clean_up = bool(self.config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE"
        )
        self.bos_token: str | None = _token_content(self.config.get("bos_token"))
        self.eos_token: str | None = _token_content(self.config.get("eos_token"))
        self.pad_token: str | None = _token_content(self.config.get("pad_token"))
        # Informational: transformers 5 ignores these flags when tokenizer.json exists (its
        # post_processor decides whether BOS/EOS are added), and so do we.
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.add_eos_token = bool(self.config.get("add_eos_token", False))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        folder = _resolve_dir(path)
        tok_file = folder / TOKENIZER_FILE
        if not tok_file.is_file():
            raise TokenizerError(f"missing file: {tok_file}")
        config = _load_config(folder)
        generation_config = _read_json(folder / GENERATION_CONFIG_FILE, required=False)
        try:
            if config.get("tokenizer_class") in ("LlamaTokenizer", "LlamaTokenizerFast"):
                tok_json = json.loads(tok_file.read_text(encoding="utf-8"))
                backend = _RustTokenizer.from_str(json.dumps(_llama_pipeline(tok_json, config)))
            else:
                backend = _RustTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception for bad files
            raise TokenizerError(f"cannot load {tok_file}: {e}") from e
        chat = ChatTemplate._from_folder(folder, config)
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
        names = [*_special_tokens_map(self.config).values(), *(_token_content(t) for t in extra)]
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
        return _clean_up_tokenization(text) if self._clean_up else text

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """Render `messages` to the prompt text (tokenize it with encode(text, add_special_tokens=False),
        as transformers does, since templates write BOS themselves)."""
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                **template_kwargs)


# ----------------------------------------------------------------------------- streaming output


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas as they arrive.

    The vLLM scheme: decode a short window of tokens before the new ones (prefix_offset..read_offset)
    and the same window extended by the new tokens, and emit the difference. The window gives
    SentencePiece decoders the context to turn a leading "▁" into a space, and text is held back
    while it ends in U+FFFD (an incomplete UTF-8 character from byte tokens). Each token costs two
    decodes of a few tokens, not a re-decode of everything.

    Without a prompt, the deltas concatenate to `tokenizer.decode(generated_ids)`; with one, to the
    part of `decode(prompt_ids + generated_ids)` after `decode(prompt_ids)`, so the first generated
    word gets its leading space. (A prompt that ends inside a character counts only up to its last
    whole character.) Call `flush()` at the end for any held-back text. This holds for valid
    UTF-8 output; a model that emits invalid byte sequences gets U+FFFD in the deltas, placed
    as the window saw them.
    """

    _PROMPT_WINDOW = 5  # prompt tokens of context, as vLLM
    _MAX_LOOKBACK = 8  # extra tokens to step back so a window never starts mid-character
    _TRIM_AT = 1024  # drop consumed ids past this many, keeping memory O(window)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, *,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer.backend
        self._skip = skip_special_tokens
        self._clean_up = tokenizer._clean_up
        ids = [int(i) for i in (prompt_ids or [])[-(self._PROMPT_WINDOW + 2 * self._MAX_LOOKBACK):]]
        self._ids = ids
        self._prefix_offset, self._read_offset = self._initial_window(len(ids))
        self._shown: int | None = None  # len(decode(window before read_offset)), cached

    def _initial_window(self, n: int) -> tuple[int, int]:
        """(prefix_offset, read_offset) for a prompt tail of n ids: both on character boundaries.

        The window must not start mid-character (byte-fallback decoders turn a whole run of byte
        tokens into U+FFFD then). A prompt that ends inside a character leaves its last tokens
        unread: their text comes out with the first generated tokens, once the character is whole.
        Boundaries are found by looking for a window that decodes without U+FFFD.
        """
        for read in range(n, max(n - 4, 0) - 1, -1):
            if read == 0:
                return 0, 0
            start = max(read - self._PROMPT_WINDOW, 0)
            for prefix in range(start, max(start - self._MAX_LOOKBACK, 0) - 1, -1):
                if _REPLACEMENT_CHAR not in self._decode(prefix, read):
                    return prefix, read
        return max(n - self._PROMPT_WINDOW, 0), n  # U+FFFD in the prompt text itself: plain window

    def _decode(self, start: int, end: int | None = None) -> str:
        text = self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)
        return _clean_up_tokenization(text) if self._clean_up else text

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one or more new token ids; return the newly completed text (maybe "")."""
        if isinstance(token_ids, int):
            return self._step(token_ids)
        return "".join(self._step(int(t)) for t in token_ids)

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        new_text = self._decode(self._prefix_offset)
        shown = self._shown_len()
        if len(new_text) <= shown or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or an incomplete character at the end: hold back
        delta = new_text[shown:]
        self._shown = None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > self._TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def flush(self) -> str:
        """Text still held back (an unfinished character decodes to U+FFFD), and reset the hold."""
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._prefix_offset)
        shown = self._shown_len()
        self._prefix_offset, self._read_offset, self._shown = self._read_offset, len(self._ids), None
        return new_text[shown:]

    def _shown_len(self) -> int:
        """Length of the window's text already emitted (or prompt); cached until the window moves."""
        if self._shown is None:
            self._shown = len(self._decode(self._prefix_offset, self._read_offset))
        return self._shown


class StopStringMatcher:
    """Cuts streamed text at the first stop string (which is not emitted, as OpenAI and vLLM do).

    `feed(delta)` returns `(text_to_emit, stopped)`. Stop strings that span several deltas are
    found, and a tail that could still become a stop string is held back until it is resolved.
    `flush()` returns the held-back text at the end of the stream.
    """

    def __init__(self, stop: Iterable[str] | str | None) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._max_len = max((len(s) for s in self.stop_strings), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # which stop string ended the text

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop_strings:
            return delta, False
        text = self._held + delta
        # Earliest match wins; at equal starts, either cut gives the same emitted text.
        best, best_stop = -1, None
        for s in self.stop_strings:
            i = text.find(s)
            if i != -1 and (best == -1 or i < best):
                best, best_stop = i, s
        if best_stop is not None:
            self.stopped, self.matched, self._held = True, best_stop, ""
            return text[:best], True
        hold = self._partial_suffix(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return k
        return 0

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
