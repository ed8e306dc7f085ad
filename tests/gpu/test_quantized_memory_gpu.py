"""On the GPU: a model quantized at load occupies its quantized bytes on the device (the loader never holds a bf16
copy of it beside the 8-bit one), and the engine gives the freed memory to KV pages.

Run on the H200: PYTHONPATH=. python3 -m pytest -q tests/gpu/test_quantized_memory_gpu.py
"""

import functools
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from bench.random_model import QWEN3_0_6B, write_random_model

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")

REPO = Path(__file__).resolve().parents[2]
UNTIED = {**QWEN3_0_6B, "tie_word_embeddings": False, "max_position_embeddings": 4096}

# Each load in a fresh process: the device's peak_bytes_in_use counts from the process's start.
MEASURE = """
import json, sys, jax
from jaxinfer.model.config import load_config
from jaxinfer.model.quantize import weight_bytes
from jaxinfer.model.weights import load_params
folder, quantization, per_layer = sys.argv[1], sys.argv[2] or None, sys.argv[3] == "1"
dev = jax.devices()[0]
before = dev.memory_stats()["bytes_in_use"]
cfg = load_config(folder, "bfloat16")
params = load_params(folder, cfg, progress=False, per_layer=per_layer, quantization=quantization)
jax.block_until_ready(params)
stats = dev.memory_stats()
held, unquantized = weight_bytes(params, cfg.tie_embeddings)
print(json.dumps(dict(in_use=stats["bytes_in_use"] - before, peak=stats["peak_bytes_in_use"] - before, held=held,
                      unquantized=unquantized)))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("q") / "qwen3", UNTIED, dtype="bfloat16", std=0.05)


@functools.cache
def _measure(folder, quantization, per_layer):
    r = subprocess.run([sys.executable, "-c", MEASURE, str(folder), quantization or "", "1" if per_layer else "0"],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_load_holds_its_quantized_bytes(model_dir, quantization, per_layer):
    bf16 = _measure(model_dir, None, per_layer)
    q = _measure(model_dir, quantization, per_layer)
    print(f"{quantization} per_layer={per_layer}: in use {q['in_use'] / 1e9:.3f} GB (its arrays {q['held'] / 1e9:.3f}), "
          f"peak {q['peak'] / 1e9:.3f} GB; bf16 in use {bf16['in_use'] / 1e9:.3f} GB")
    assert q["unquantized"] == bf16["held"]
    assert abs(q["in_use"] - q["held"]) < 0.02 * q["held"]                 # nothing else left behind
    assert q["in_use"] < 0.62 * bf16["in_use"]                            # untied: bf16 embedding, 8-bit rest
    assert q["peak"] < q["held"] + 0.15 * bf16["held"]   # a few layers' (or lm_head chunks') temporaries, no bf16 copy


def test_engine_gives_the_freed_memory_to_kv_pages(model_dir):
    from jaxinfer.engine.engine import Engine
    from jaxinfer.model.quantize import weight_bytes

    kv, weights = {}, {}
    for quantization in (None, "int8"):   # max_num_seqs large enough that free memory, not the cap, sizes the pool
        engine = Engine(model_dir, dtype="bfloat16", ops="reference", quantization=quantization, progress=False,
                        skip_tokenizer_init=True, max_num_seqs=256, compile_all_at_start=False)
        kv[quantization], weights[quantization] = engine.kv_bytes, weight_bytes(engine.runner.params)[0]
        print(engine.summary)
        del engine
        gc.collect()
    saved, gained = weights[None] - weights["int8"], kv["int8"] - kv[None]
    assert abs(gained - saved) < 0.05 * saved, (saved, gained)
