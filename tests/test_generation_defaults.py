"""The model's generation_config.json as sampling defaults (vLLM's --generation-config auto)."""

import json
import shutil

import pytest

from conftest import STORIES
from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import ModelLoadError
from jaxinfer.engine.generation_defaults import read_generation_defaults
from jaxinfer.serve.params import ModelInfo, prepare_chat, prepare_completion
from jaxinfer.serve.protocol import ChatCompletionRequest, CompletionRequest
from jaxinfer.text import ChatTemplate, Tokenizer

QWEN3_GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                           "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                           "transformers_version": "4.51.0"}


def _with_generation_config(tmp_path, config):
    d = tmp_path / "model"
    shutil.copytree(STORIES, d)
    (d / "generation_config.json").write_text(json.dumps(config))
    return d


def test_reads_the_sampling_fields_and_nothing_else(tmp_path):
    d = _with_generation_config(tmp_path, {**QWEN3_GENERATION_CONFIG, "max_new_tokens": 40, "repetition_penalty": 1.1,
                                           "min_p": 0.0})
    assert read_generation_defaults("auto", d) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                                   "repetition_penalty": 1.1, "max_tokens": 40}
    assert read_generation_defaults("none", d) == {} and read_generation_defaults(None, d) == {}
    assert read_generation_defaults(str(d), tmp_path) == read_generation_defaults("auto", d)   # a folder named
    assert read_generation_defaults("auto", STORIES) == {}        # stories260k's has no sampling fields
    (d / "generation_config.json").unlink()
    assert read_generation_defaults("auto", d) == {}              # none in the model folder: no defaults
    with pytest.raises(ModelLoadError, match="not found"):
        read_generation_defaults(str(tmp_path / "elsewhere"), d)  # a folder named must have one


@pytest.mark.parametrize("bad,match", [({"temperature": "hot"}, "temperature must be a number"),
                                       ({"top_p": 1.5}, "top_p"), ({"top_k": 2.5}, "top_k"),
                                       ({"temperature": -1}, "temperature"), ({"max_new_tokens": 0}, "max_tokens"),
                                       ({"top_k": True}, "top_k must be a number")])
def test_a_bad_value_is_a_clear_load_error(tmp_path, bad, match):
    d = _with_generation_config(tmp_path, bad)
    with pytest.raises(ModelLoadError, match=match):
        read_generation_defaults("auto", d)
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        LLM(d, progress=False)


def test_requests_without_params_get_the_defaults(tmp_path):
    """LLM.generate without SamplingParams: the generation config's (here greedy, 7 tokens), as explicit
    params give; with generation_config="none" the library's (16 tokens). Explicit params are kept."""
    d = _with_generation_config(tmp_path, {"temperature": 0, "max_new_tokens": 7})
    llm = LLM(d, max_num_seqs=2, progress=False)
    got = llm.generate(["Once upon a time"])[0]
    want = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=7))[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and len(got.outputs[0].token_ids) == 7
    assert len(llm.generate(["Once upon a time"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids) == 3
    plain = LLM(d, max_num_seqs=2, progress=False, generation_config="none")
    assert plain.engine.default_sampling_params() == SamplingParams()


def test_the_server_fills_what_a_request_leaves_out():
    """The HTTP layer: fields a request omits take the generation config's; given ones are kept; a top-k
    past the vocabulary is clipped either way; chat's max_tokens defaults to max_new_tokens within the
    room (completions keep OpenAI's 16 unless the request sends null, as vLLM's)."""
    info = ModelInfo(name="m", root="/m", tokenizer=Tokenizer.from_dir(STORIES), vocab_size=512, max_model_len=256,
                     sampling_defaults={"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 40},
                     chat=ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}"))
    p = prepare_completion(CompletionRequest(prompt="Once upon a time"), info).params[0]
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 0.95, 16)
    assert prepare_completion(CompletionRequest(prompt="Once", max_tokens=None), info).params[0].max_tokens == 40
    p = prepare_completion(CompletionRequest(prompt="Once", temperature=0, top_k=5000, max_tokens=3), info).params[0]
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.0, 512, 0.95, 3)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = prepare_chat(chat, info).params[0]
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 40)
    info.sampling_defaults = {}
    p = prepare_chat(chat, info).params[0]
    assert (p.temperature, p.top_k, p.top_p) == (1.0, -1, 1.0) and p.max_tokens > 40   # the room left
