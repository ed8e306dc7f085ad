"""Chat templates: Jinja templates rendered exactly the way Hugging Face transformers'
`apply_chat_template` does (sandboxed, with its filters, globals and `{% generation %}` tag)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxinfer.text.tokenizer_config import CONFIG_FILE, TokenizerError, load_config, resolve_dir, special_tokens_map

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


class ChatTemplateError(TokenizerError):
    """A chat template that is missing, does not compile, or raised while rendering."""


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
        folder = p.parent if p.is_file() else resolve_dir(p)
        chat = cls.from_folder(folder, load_config(folder))
        if not chat.templates:
            raise ChatTemplateError(f"no chat template in {folder} ({CONFIG_FILE} or {CHAT_TEMPLATE_FILE})")
        return chat

    @classmethod
    def from_folder(cls, folder: Path, config: Mapping[str, Any]) -> ChatTemplate:
        """The templates of a tokenizer folder whose config is already read; none is no error."""
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
        return cls(templates, special_tokens_map(config), source=str(folder))

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


def load_chat_template(template: str | os.PathLike[str]) -> str:
    """A chat template given as a file's path or as the template text itself (vLLM's --chat-template),
    checked to compile. A string naming no readable file is taken as the template when it has a "{",
    "}" or newline in it; otherwise it was meant as a path, and ChatTemplateError says it cannot be read."""
    try:
        source = Path(template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as e:   # ValueError: a NUL byte in the "path"
        if isinstance(template, os.PathLike) or not any(c in template for c in "{}\n"):
            raise ChatTemplateError(f"cannot read the chat template file {template}: {e}") from e
        source = template
    _compile(source)
    return source
