"""The grammar engine on the host (sampling.structured) with the real tokenizers: constraints compile into
matchers whose bitmasks are sized for the model's vocabulary, advance with tokens, end the output; bad
constraints raise StructuredOutputError. No model here: a walk that takes random allowed tokens stands
in for the sampler."""

import json
import re

import jsonschema
import numpy as np
import pytest

from conftest import STORIES, TOKENIZERS
from jaxinfer.sampling import SamplingParams, SamplingParamsError, StructuredOutput
from jaxinfer.sampling.structured import (GrammarCompiler, StructuredOutputError, allocate_bitmask, allowed_tokens,
                                          bitmask_words)
from jaxinfer.text import Tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["stories", "qwen3", "gpt2", "llama2"])
def compiler(request):
    d = STORIES if request.param == "stories" else TOKENIZERS / request.param
    tok = Tokenizer.from_dir(d)
    vocab = tok.vocab_size + 77   # a model's embedding padded past the tokenizer's ids
    return tok, GrammarCompiler(tok, vocab, tok.eos_token_ids or (0,))


@pytest.fixture(scope="module")
def one_char(compiler):
    """Per token id: its text is one character (the walk prefers those, so that a closing quote or bracket
    is as likely as any other character and the walk ends)."""
    tok, c = compiler
    return np.array([len(tok.decode([i])) == 1 for i in range(tok.vocab_size)] + [False] * 77)


def walk(compiler: GrammarCompiler, constraint: StructuredOutput, seed: int, one_char: np.ndarray,
         max_tokens: int = 400) -> list[int]:
    """Emit random allowed tokens (one-character ones 4 times in 5, where any is allowed) until the matcher
    ends (or max_tokens)."""
    rng = np.random.default_rng(seed)
    m = compiler.matcher(constraint)
    mask = allocate_bitmask(2, compiler.vocab_size)
    out = []
    for _ in range(max_tokens):
        if m.finished:
            break
        mask[1] = 0
        compiler.fill(mask, [(m, 1)])
        allowed = allowed_tokens(mask[1], compiler.vocab_size)
        assert len(allowed) and allowed.max() < compiler.vocab_size - 77
        short = allowed[one_char[allowed]]
        tok = int(rng.choice(short if len(short) and rng.random() < 0.8 else allowed))
        assert m.advance(tok), m.error
        out.append(tok)
    assert m.finished, "the walk did not end"
    return out


def text_of(tok: Tokenizer, ids: list[int]) -> str:
    eos = set(tok.eos_token_ids)
    return tok.decode([i for i in ids if i not in eos])


def test_mask_sized_for_the_model_vocabulary(compiler):
    tok, c = compiler
    assert bitmask_words(c.vocab_size) == -(-c.vocab_size // 32)
    mask = allocate_bitmask(1, c.vocab_size)
    mask[:] = 0
    c.fill(mask, [(c.matcher(StructuredOutput(json_object=True)), 0)])
    allowed = allowed_tokens(mask[0], c.vocab_size)
    assert len(allowed) and allowed.max() < tok.vocab_size   # padding ids never allowed
    assert all(tok.decode([int(i)]).lstrip().startswith("{") for i in allowed)


@pytest.mark.parametrize("seed", range(3))
def test_random_walks_give_valid_json(compiler, one_char, seed):
    tok, c = compiler
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "bc"]},
                                                        "maxItems": 3},
                                               "person": PERSON, "score": {"type": "number", "minimum": -1,
                                                                           "maximum": 1}},
              "required": ["tags", "person"], "additionalProperties": False}
    ids = walk(c, StructuredOutput(json=schema), seed, one_char)
    jsonschema.validate(json.loads(text_of(tok, ids)), schema)


def test_regex_choice_and_grammar(compiler, one_char):
    tok, c = compiler
    out = text_of(tok, walk(c, StructuredOutput(regex=r"[a-c]{2,4}-[0-9][0-9]"), 0, one_char))
    assert re.fullmatch(r"[a-c]{2,4}-[0-9][0-9]", out.strip()), out
    assert text_of(tok, walk(c, StructuredOutput(choice=["yes", "no", "maybe"]), 1, one_char)).strip() in ("yes", "no", "maybe")
    lark = 'start: "(" expr ")"\nexpr: NUMBER | NUMBER "+" expr\nNUMBER: /[0-9]/'
    out = text_of(tok, walk(c, StructuredOutput(grammar=lark), 2, one_char))
    assert re.fullmatch(r"\(\d(\+\d)*\)", out.strip()), out
    gbnf = 'root ::= "x" [0-9]+ "y"'
    assert re.fullmatch(r"x\d+y", text_of(tok, walk(c, StructuredOutput(grammar=gbnf), 3, one_char)).strip())


def test_advance_reports_a_token_outside_the_grammar():
    tok = Tokenizer.from_dir(TOKENIZERS / "qwen3")
    c = GrammarCompiler(tok, 151936, tok.eos_token_ids)
    m = c.matcher(StructuredOutput(choice=["yes"]))
    assert not m.advance(tok.encode("no", add_special_tokens=False)[0])
    assert m.error and m.finished
    m = c.matcher(StructuredOutput(choice=["yes"]))
    assert m.advance(tok.encode("yes", add_special_tokens=False)[0]) and m.accepting


@pytest.mark.parametrize("constraint, reason", [
    (dict(json={"type": "frobnicate"}), "frobnicate"),
    (dict(json={"type": "string", "pattern": "a(b"}), "regex"),
    (dict(regex="a(b"), "unclosed group"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
    (dict(grammar="root ::= ("), "grammar"),
])
def test_bad_constraints_raise_with_the_reason(constraint, reason):
    tok = Tokenizer.from_dir(STORIES)
    c = GrammarCompiler(tok, 512, tok.eos_token_ids)
    with pytest.raises(StructuredOutputError, match=re.escape(reason)):
        c.matcher(StructuredOutput(**constraint))


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"), (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1, 2]), "JSON Schema"), (dict(choice=[]), "choice"), (dict(choice=["a", 3]), "choice"),
    (dict(regex=""), "regex"), (dict(json_object=1), "json_object"),
])
def test_structured_output_validates_its_fields(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        StructuredOutput(**kwargs)


def test_sampling_params_takes_a_structured_output():
    s = StructuredOutput(json='{"type": "integer"}')
    assert s == StructuredOutput(json={"type": "integer"}) and hash(s) == hash(StructuredOutput(json={"type": "integer"}))
    assert SamplingParams(structured=s).structured.kind == "json"
    with pytest.raises(SamplingParamsError, match="structured"):
        SamplingParams(structured={"json": {}})



@pytest.mark.parametrize("seed", range(2))
def test_draft_masks_equal_a_matcher_advanced_token_by_token(compiler, one_char, seed):
    """Speculative decoding's masks (fill_with_drafts: row first + j after drafts[:j], several requests at once)
    against the reference: a fresh matcher advanced token by token, one fill a position; the matchers do not move.
    Drafts are cut before the first token the grammar refuses (valid_prefix)."""
    tok, c = compiler
    rng = np.random.default_rng(seed)
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
                                               "person": PERSON}, "required": ["tags", "person"],
              "additionalProperties": False}
    constraint = StructuredOutput(json=schema)
    padding = c.vocab_size - 1   # past the tokenizer's ids: never allowed
    rows, width = [], 5
    for r in range(3):
        full = walk(c, constraint, 10 * seed + r, one_char)
        start, k = int(rng.integers(0, len(full) - 4)), int(rng.integers(0, width))
        m = c.matcher(constraint)
        for t in full[:start]:
            assert m.advance(t)
        drafts = full[start:start + k]
        assert m.valid_prefix(drafts) == len(drafts)
        assert m.valid_prefix(drafts[:1] + [padding] + drafts[1:]) == min(1, len(drafts))
        rows.append((m, r * width, drafts, full[:start], full[start:]))
    mask = allocate_bitmask(3 * width, c.vocab_size)
    mask[:] = 7   # the rows not written below must stay as they were
    c.fill_with_drafts(mask, [(m, first, d) for m, first, d, _, _ in rows])
    ref = allocate_bitmask(1, c.vocab_size)
    for m, first, drafts, before, rest in rows:
        for j in range(len(drafts) + 1):
            fresh = c.matcher(constraint)
            for t in before + drafts[:j]:
                assert fresh.advance(t)
            ref[0] = 0
            fresh.fill(ref, 0)
            assert np.array_equal(mask[first + j], ref[0]), (first, j)
        assert np.all(mask[first + len(drafts) + 1:first + width] == 7)
        assert m.valid_prefix(rest) == len(rest)   # the matcher did not move
