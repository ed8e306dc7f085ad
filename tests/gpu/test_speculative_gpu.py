"""On the GPU: speculative decoding on the Pallas path gives the tokens decoding without it gives (float32: the
verify step's kernels and the decode step's agree closely enough for greedy text), for n-gram and a draft model,
batched and alone; and on random float32 weights at a small Qwen3 shape, with the verify attention kernel.

Run on the H200: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_speculative_gpu.py (stories260k and
llama2xs-260k copied to .carry/).
"""

from pathlib import Path

import jax
import pytest

from conftest import record_steps
from jaxinfer.engine.llm import LLM
from bench.random_model import QWEN3_0_6B, write_random_model
from jaxinfer.sampling import SamplingParams

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")

REPO = Path(__file__).resolve().parents[2]


def _model(name):
    return next((p for p in (REPO / ".carry" / name, REPO.parent / "shared" / "models" / name) if p.is_dir()), None)


STORIES, XS = _model("stories260k"), _model("llama2xs-260k")
PROMPTS = ["Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom had a red",
           "Once upon a time, there was a little girl named Lily. She loved to play. One day, Lily",
           "Lily and Tom went to the park. Lily and Tom went to the park. Lily and Tom went to"]


def _tokens(model, prompts, **kw):
    llm = LLM(model, dtype="float32", ops="pallas", max_num_seqs=4, max_num_batched_tokens=64, progress=False,
              cache_dir="", **kw)
    ran = record_steps(llm.engine.runner)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0,
                                                                                 ignore_eos=True))]
    return out, llm, ran


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_stories_greedy_tokens_unchanged(speculative):
    spec = "ngram" if speculative == "ngram" else f"draft:{XS}"
    want, _, _ = _tokens(STORIES, PROMPTS)
    got, llm, ran = _tokens(STORIES, PROMPTS, speculative=spec)
    assert got == want
    alone, _, _ = _tokens(STORIES, PROMPTS[:1], speculative=spec)
    assert alone == want[:1]
    assert llm.engine.speculator.stats.accepted > 0
    assert any(n.startswith("verify-greedy-verify") for n in ran)   # the dense layout: the verify kernel


def test_random_qwen3_greedy_tokens_unchanged_with_its_own_draft(tmp_path):
    """The model as its own draft: every draft accepted, Q = 8 rows a verify through the kernel (2 query heads
    a KV head: 16 rows a tile)."""
    model = write_random_model(tmp_path / "q", {**QWEN3_0_6B, "num_hidden_layers": 2, "max_position_embeddings": 2048},
                               dtype="float32", std=0.05)
    prompt = [[11, 12, 13, 14, 15, 16] * 20]
    want, _, _ = _tokens(model, prompt, skip_tokenizer_init=True)
    got, llm, ran = _tokens(model, prompt, skip_tokenizer_init=True, speculative=f"draft:{model}",
                            num_speculative_tokens=7)
    assert got == want
    stats = llm.engine.speculator.stats
    assert stats.accepted == stats.drafted > 0


def test_dflash_greedy_tokens_unchanged():
    """The tiny Qwen3 with its random DFlash drafter (tests/data/models/dflash-tiny): the captured layer states,
    the drafter's paged pool and every decode step verified, on the Pallas path."""
    model, drafter = REPO / "tests" / "data" / "models" / "qwen3", REPO / "tests" / "data" / "models" / "dflash-tiny"
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(20, 60))]
    want, _, _ = _tokens(model, prompts, skip_tokenizer_init=True)
    got, llm, ran = _tokens(model, prompts, skip_tokenizer_init=True, speculative=f"dflash:{drafter}")
    assert got == want
    assert llm.engine.speculator.stats.verify_steps > 0
