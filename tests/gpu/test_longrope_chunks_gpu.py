"""On the GPU, at Phi-4-mini's shapes (its first 2 layers, random float32 weights, LongRoPE's original length 4,096):
a 4,200-token prompt in chunks of the default budget (2,048: the first two end at or before 4,096) gives the greedy
tokens it gives in one prompt step (float32 products at full precision: with TF32's, both paths part at token
12 on the H200), on the Pallas path (split steps, fresh and prefixed prompt attention) and on the
reference's. The CPU tests check the same on a tiny Phi-3 (tests/test_dense_families.py).

Run on the H200: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_longrope_chunks_gpu.py
"""

import gc

import jax
import numpy as np
import pytest

from bench.random_model import shape_config, write_random_model
from jaxinfer.engine.llm import LLM
from jaxinfer.sampling import SamplingParams

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")

PROMPT_LEN, MAX_LEN = 4200, 4352


def _greedy(model_dir, ops, prompt, budget):
    with jax.default_matmul_precision("highest"):   # XLA's float32 products are TF32 on the GPU by default
        return _greedy_at_precision(model_dir, ops, prompt, budget)


def _greedy_at_precision(model_dir, ops, prompt, budget):
    llm = LLM(model_dir, dtype="float32", ops=ops, max_num_seqs=1, max_model_len=MAX_LEN,
              max_num_batched_tokens=budget, progress=False, skip_tokenizer_init=True, num_pages=MAX_LEN // 16 + 1)
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    del llm
    gc.collect()
    return out.outputs[0].token_ids


@pytest.mark.parametrize("ops", ["pallas", "reference"])
def test_long_prompt_in_chunks_equals_one_step(ops, tmp_path):
    model_dir = write_random_model(tmp_path / "phi4-mini", shape_config("phi4-mini@2"), dtype="float32", std=0.05)
    prompt = np.random.default_rng(0).integers(1000, 100000, PROMPT_LEN).tolist()
    assert _greedy(model_dir, ops, prompt, 2048) == _greedy(model_dir, ops, prompt, 8192)
