"""The Pallas op set, in interpret mode on the CPU, gives the reference path's greedy tokens end to end."""

import numpy as np

from conftest import DATA, STORIES
from jaxinfer import LLM, SamplingParams


def _greedy(model_dir, ops, prompts, n, **kw):
    llm = LLM(model_dir, ops=ops, max_num_seqs=2, max_num_batched_tokens=16, decode_steps=4, progress=False, **kw)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))]


def test_stories_pallas_interpret_equals_reference():
    prompts = ["Once upon a time", "The dog ran"]
    assert _greedy(STORIES, "pallas-interpret", prompts, 12) == _greedy(STORIES, "reference", prompts, 12)


def test_qwen3_pallas_interpret_equals_reference():
    golden = np.load(DATA / "golden" / "qwen3.npz")
    prompts = [golden["prompt_0"].tolist(), golden["prompt_1"].tolist()]
    kw = dict(skip_tokenizer_init=True)
    ours = _greedy(DATA / "models" / "qwen3", "pallas-interpret", prompts, 8, **kw)
    assert ours == _greedy(DATA / "models" / "qwen3", "reference", prompts, 8, **kw)
    assert ours == [golden["greedy_0"][:8].tolist(), golden["greedy_1"][:8].tolist()]
