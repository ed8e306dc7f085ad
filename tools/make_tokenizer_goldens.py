"""Write tests/data/golden/tokenizers.json from Hugging Face transformers (the reference).

Run with the reference environment, never from the jaxinfer package:

    .venv-ref/bin/python tools/make_tokenizer_goldens.py

It records, for the real tokenizers in ../shared, what `AutoTokenizer` gives for encode and
decode, and what `apply_chat_template(..., tokenize=False)` renders for the Qwen3 and Llama-3
chat templates. tests/test_tokenizer.py checks jaxinfer.text against this byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tokenizers
import transformers
from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
OUT = REPO / "tests" / "data" / "golden" / "tokenizers.json"

# name -> folder relative to ../shared
FOLDERS = {
    "qwen3": "tokenizers/qwen3",
    "gpt2": "tokenizers/gpt2",
    "llama2": "tokenizers/llama2",
    "stories": "models/stories260k",
}

TEXTS = [
    "Hello, world!",
    "Hello world",
    " Hello world",
    "trailing space ",
    "multiple   spaces  between",
    "\ttabs\tand\nnewlines\n\n end",
    "héllo wörld, ñandú, Ångström, naïve café",
    "日本語のテキスト、中文字符和한국어",
    "emoji 😀👍🏽🇫🇷 family 👨\u200d👩\u200d👧 end",
    "",
    " ",
    "  \n ",
    "<|im_start|>user\nhi<|im_end|>",
    "<s> inside </s> text<|endoftext|>",
    "code: def f(x):\n    return x ** 2  # 1234567890",
    "Once upon a time, there was a little girl named Lily.",
]

# Partial prefixes of these are decoded too, to pin down how incomplete UTF-8 decodes.
PARTIAL_TEXTS = ["a€b 😀中", "emoji 😀👍🏽🇫🇷 family 👨\u200d👩\u200d👧 end"]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in °C for a city <b>&</b> 'quoted' — ünïcödé",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "days": {"type": "integer", "description": "Days ahead"},
            },
            "required": ["city"],
        },
    },
}

SYSTEM_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
    {"role": "user", "content": "Tell me a joke about cats 🐱."},
]
THINK_HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nThe user asks 2+2. That is 4.\n</think>\n\n2+2 = 4."},
    {"role": "user", "content": "And 3+3?"},
]
THINK_LAST = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\nIt is 4."},
]
REASONING_FIELD = [
    {"role": "user", "content": "Why is the sky blue?"},
    {"role": "assistant", "content": "Rayleigh scattering.", "reasoning_content": "Think about light."},
]
TOOL_ROUND_TRIP = [
    {"role": "user", "content": "What's the weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 1}}}
        ],
    },
    {"role": "tool", "content": '{"temp_c": 21, "sky": "sunny"}'},
]
UNICODE_AND_MARKUP = [
    {"role": "user", "content": "  héllo 😀 <b>&amp;</b> \"quotes\"\n\twith tab  "},
]

CHATS = {
    "qwen3": [
        {"name": "system_user_gen", "messages": SYSTEM_USER, "add_generation_prompt": True},
        {"name": "system_user_nogen", "messages": SYSTEM_USER, "add_generation_prompt": False},
        {"name": "multi_turn_gen", "messages": MULTI_TURN, "add_generation_prompt": True},
        {"name": "multi_turn_nogen", "messages": MULTI_TURN, "add_generation_prompt": False},
        {
            "name": "no_thinking",
            "messages": MULTI_TURN,
            "add_generation_prompt": True,
            "kwargs": {"enable_thinking": False},
        },
        {
            "name": "thinking_true",
            "messages": SYSTEM_USER,
            "add_generation_prompt": True,
            "kwargs": {"enable_thinking": True},
        },
        {"name": "think_in_history", "messages": THINK_HISTORY, "add_generation_prompt": True},
        {"name": "think_last_assistant", "messages": THINK_LAST, "add_generation_prompt": False},
        {"name": "reasoning_content_field", "messages": REASONING_FIELD, "add_generation_prompt": False},
        {"name": "tools_system_user", "messages": SYSTEM_USER, "add_generation_prompt": True, "tools": [WEATHER_TOOL]},
        {"name": "tools_user_only", "messages": MULTI_TURN[:1], "add_generation_prompt": True, "tools": [WEATHER_TOOL]},
        {
            "name": "tool_call_round_trip",
            "messages": TOOL_ROUND_TRIP,
            "add_generation_prompt": True,
            "tools": [WEATHER_TOOL],
        },
        {"name": "unicode_markup", "messages": UNICODE_AND_MARKUP, "add_generation_prompt": True},
    ],
    "llama3": [
        {"name": "system_user_gen", "messages": SYSTEM_USER, "add_generation_prompt": True},
        {"name": "system_user_nogen", "messages": SYSTEM_USER, "add_generation_prompt": False},
        {"name": "multi_turn_gen", "messages": MULTI_TURN, "add_generation_prompt": True},
        {"name": "multi_turn_nogen", "messages": MULTI_TURN, "add_generation_prompt": False},
        {"name": "unicode_markup", "messages": UNICODE_AND_MARKUP, "add_generation_prompt": True},
    ],
}


def load_llama3() -> PreTrainedTokenizerFast:
    """llama3/ has no vocabulary: give transformers an empty model plus the real config."""
    cfg = json.loads((SHARED / "tokenizers/llama3/tokenizer_config.json").read_text())
    cfg.pop("tokenizer_class", None)
    cfg["added_tokens_decoder"] = {int(k): AddedToken(**v) for k, v in cfg["added_tokens_decoder"].items()}
    return PreTrainedTokenizerFast(tokenizer_object=RustTokenizer(models.BPE()), **cfg)


def tokenizer_goldens(tok) -> dict:
    encodes, decodes = [], []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True)
        encodes.append({"text": text, "ids": ids, "ids_no_special": tok.encode(text, add_special_tokens=False)})
        for skip in (True, False):
            text_out = tok.decode(ids, skip_special_tokens=skip)
            decodes.append({"ids": ids, "skip_special_tokens": skip, "text": text_out})
    for text in PARTIAL_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        # every prefix (ends inside a character), and all but the first id (starts inside one)
        for part in [ids[:k] for k in range(1, len(ids) + 1)] + [ids[1:]]:
            text_out = tok.decode(part, skip_special_tokens=True)
            decodes.append({"ids": part, "skip_special_tokens": True, "text": text_out})
    return {
        "class": type(tok).__name__,
        "len": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "special_tokens_map": tok.special_tokens_map,
        "encode": encodes,
        "decode": decodes,
    }


def chat_goldens(tok, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        kwargs = case.get("kwargs", {})
        text = tok.apply_chat_template(
            case["messages"],
            tools=case.get("tools"),
            add_generation_prompt=case["add_generation_prompt"],
            tokenize=False,
            **kwargs,
        )
        out.append({**case, "tools": case.get("tools"), "kwargs": kwargs, "text": text})
    return out


def main() -> int:
    golden: dict = {
        "made_by": "tools/make_tokenizer_goldens.py",
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "tokenizers": {},
        "chat": {},
    }
    loaded = {}
    for name, folder in FOLDERS.items():
        tok = AutoTokenizer.from_pretrained(str(SHARED / folder))
        loaded[name] = tok
        golden["tokenizers"][name] = {"folder": folder, **tokenizer_goldens(tok)}
    loaded["llama3"] = load_llama3()
    for name, cases in CHATS.items():
        golden["chat"][name] = chat_goldens(loaded[name], cases)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
