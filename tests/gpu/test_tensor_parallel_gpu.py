"""On several GPUs (nvidia-h200-x2 or larger): the Pallas path at tensor parallel 2 (and 4, 8 where there are the
GPUs) at Qwen3-0.6B's widths, four layers, float32: the greedy tokens of TP 1's Pallas path and logits within
float32 tolerance; bf16 logits close. Also in float32 against TP 1: Phi-4-mini's widths (a fused gate_up_proj,
partial rotary, 24 heads), Qwen3 with 2 KV heads (held in groups at TP 4 and 8), the int8 and float8 KV caches, and
int8 and fp8 weights quantized at load (the 8-bit GEMVs and GEMMs on each device's rows and columns).
Skipped with fewer than two GPUs.

Run: PYTHONPATH=. python3 -m pytest -q -o addopts= tests/gpu/test_tensor_parallel_gpu.py
"""

import gc

import jax
import numpy as np
import pytest

from bench.random_model import PHI4_MINI, QWEN3_0_6B, write_random_model
from jaxinfer.engine.llm import LLM
from jaxinfer.model.config import load_config
from jaxinfer.model.transformer import prompt_logits
from jaxinfer.model.weights import load_params
from jaxinfer.ops import get_ops
from jaxinfer.ops.tensor_parallel import tensor_parallel_ops
from jaxinfer.runner.mesh import make_mesh
from jaxinfer.sampling import SamplingParams

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
pytestmark = pytest.mark.skipif(len(GPUS) < 2, reason="needs two GPUs or more")
SIZES = [n for n in (2, 4, 8) if n <= len(GPUS)]
SMALL = {**QWEN3_0_6B, "num_hidden_layers": 4, "max_position_embeddings": 2048}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tp") / "qwen3", SMALL, dtype="float32", std=0.05)


def _greedy(model_dir, n: int, dtype: str, **settings) -> list[int]:
    llm = LLM(model_dir, dtype=dtype, ops="pallas", tensor_parallel_size=n, max_num_seqs=2, max_model_len=512,
              max_num_batched_tokens=128, progress=False, skip_tokenizer_init=True, num_pages=2 * 512 // 16 + 1,
              **settings)
    prompt = np.random.default_rng(0).integers(100, 10000, 100).tolist()
    out = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    del llm
    gc.collect()
    return out


def test_greedy_tokens_equal_tp1_float32(model_dir):
    want = _greedy(model_dir, 1, "float32")
    for n in SIZES:
        assert _greedy(model_dir, n, "float32") == want, n


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 0.25)])
def test_prompt_logits_close_to_tp1(model_dir, dtype, tol):
    cfg = load_config(model_dir, dtype)
    ops = get_ops("pallas")
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 200)
    ref = np.asarray(prompt_logits(cfg, ops, load_params(model_dir, cfg, progress=False), ids))
    for n in SIZES:
        mesh = make_mesh(n)
        out = np.asarray(prompt_logits(cfg, tensor_parallel_ops(ops, mesh),
                                       load_params(model_dir, cfg, progress=False, mesh=mesh), ids))
        assert np.abs(out - ref).max() < tol * max(1.0, np.abs(ref).max()), (n, np.abs(out - ref).max())
        assert (out.argmax(-1) == ref.argmax(-1)).mean() > 0.95, n


@pytest.mark.parametrize("shape", ["phi4-mini", "qwen3-2-kv-heads"])
def test_fused_gate_up_and_kv_heads_in_groups_equal_tp1(tmp_path, shape):
    config = {**PHI4_MINI, "num_hidden_layers": 4, "max_position_embeddings": 4096} if shape == "phi4-mini" \
        else {**SMALL, "num_key_value_heads": 2}
    model_dir = write_random_model(tmp_path / shape, config, dtype="float32", std=0.05)
    want = _greedy(model_dir, 1, "float32")
    for n in SIZES:
        assert _greedy(model_dir, n, "float32") == want, n


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_8bit_kv_caches_equal_tp1(model_dir, kv_cache_dtype):
    want = _greedy(model_dir, 1, "float32", kv_cache_dtype=kv_cache_dtype)
    assert _greedy(model_dir, 2, "float32", kv_cache_dtype=kv_cache_dtype) == want


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_8bit_weights_equal_tp1(model_dir, quantization):
    want = _greedy(model_dir, 1, "float32", quantization=quantization)
    for n in SIZES:
        assert _greedy(model_dir, n, "float32", quantization=quantization) == want, n
