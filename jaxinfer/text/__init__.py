"""Text: the tokenizer (tokenizer.json), chat templates, incremental detokenization and stop strings."""

from jaxinfer.text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from jaxinfer.text.detokenizer import IncrementalDetokenizer
from jaxinfer.text.stop_strings import StopStringMatcher
from jaxinfer.text.tokenizer import Tokenizer
from jaxinfer.text.tokenizer_config import TokenizerError

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "Tokenizer",
    "TokenizerError",
    "load_chat_template",
]
