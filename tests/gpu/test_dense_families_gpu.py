"""On the GPU, at the real shapes of Phi-4-mini, Gemma 3 1B and Apertus 8B (their first layers, random float32
weights): the Pallas path's greedy tokens equal the reference path's. The CPU tests check both against
transformers on tiny models (tests/test_dense_families.py); this checks the kernels at these head dims and widths
(Gemma's head_dim 256 and one KV head; Phi-4-mini's partial rotary dims; Apertus' ungated MLP).

Run on the H200: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_dense_families_gpu.py
"""

import gc

import jax
import pytest

from bench.random_model import shape_config, write_random_model
from jaxinfer.engine.llm import LLM
from jaxinfer.sampling import SamplingParams

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")

# gemma3-1b@6: five sliding-window layers and its first global one (the prompt stays inside the 512 window)
SHAPES = ["phi4-mini@2", "gemma3-1b@6", "apertus-8b@2"]


def _greedy(model_dir, ops, prompts, n):
    llm = LLM(model_dir, dtype="float32", ops=ops, max_num_seqs=2, max_model_len=512, max_num_batched_tokens=128,
              progress=False, skip_tokenizer_init=True, num_pages=2 * 512 // 16 + 1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    del llm
    gc.collect()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("shape", SHAPES)
def test_pallas_greedy_equals_reference_at_real_shapes(shape, tmp_path):
    model_dir = write_random_model(tmp_path / shape, shape_config(shape), dtype="float32", std=0.05)
    prompts = [list(range(1000, 1040)), list(range(5000, 5003))]   # a prompt's rows and a batch-1 GEMV's
    ref = _greedy(model_dir, "reference", prompts, 96)
    assert _greedy(model_dir, "pallas", prompts, 96) == ref
