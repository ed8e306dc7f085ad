"""Write a Hugging Face-format model folder with random weights, for tests and benchmarks.

The tensor names and shapes come from the same declarative map that loads them (weights.RULES),
so a folder written here exercises the real loader. Values are N(0, std) (norm scales 1), drawn
with jax.random on the default device, so real shapes (billions of parameters) are quick on a GPU.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxinfer.model.config import config_from_hf
from jaxinfer.model.weights import RULES

# Configs of real models (shapes only), as their config.json files give them.
QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151645, hidden_act="silu")
QWEN3_4B = {**QWEN3_0_6B, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
            "intermediate_size": 9728}
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                 max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=128000, eos_token_id=128009, hidden_act="silu",
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192), rope_theta=500000.0)
# A 2-layer, 64-wide Qwen3: the benchmarks' CPU smoke runs.
TINY = {**QWEN3_0_6B, "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 8192}
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-4b": QWEN3_4B, "llama3-8b": LLAMA3_8B, "tiny": TINY}


def write_random_model(out_dir: str | Path, hf_config: dict[str, Any], dtype: str = "bfloat16", seed: int = 0,
                       std: float = 0.02, tokenizer_dir: str | Path | None = None) -> Path:
    """Write config.json, generation_config.json and model.safetensors; copy a tokenizer if given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_from_hf(hf_config, dtype)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[dtype]
    key = jax.random.key(seed)
    tensors: dict[str, np.ndarray] = {}
    prefix = "transformer." if cfg.family == "gpt2" else ""
    for rule in RULES[cfg.family]:
        if not rule.when(cfg):
            continue
        layers = range(cfg.num_layers) if rule.per_layer else [None]
        for src, shape in zip(rule.sources, rule.shapes(cfg)):
            for i in layers:
                key, sub = jax.random.split(key)
                if src.endswith(("norm.weight", "layernorm.weight")) or ".ln_" in src:
                    value = jnp.ones(shape, jnp.float32)
                else:
                    value = std * jax.random.normal(sub, shape, jnp.float32)
                if rule.transpose and len(shape) == 2:
                    value = value.T
                tensors[prefix + src.format(i=i)] = np.asarray(value.astype(dtype)).astype(np_dtype)
    # written under another name, then renamed: a process killed mid-write (a bench's time limit) leaves no
    # truncated model.safetensors for bench_model to take as written
    partial = out / "model.safetensors.partial"
    save_file(tensors, partial)
    os.replace(partial, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": dtype}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": hf_config.get("eos_token_id")}))
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src_file = Path(tokenizer_dir) / name
            if src_file.is_file():
                (out / name).write_bytes(src_file.read_bytes())
    return out


def bench_model(models_dir: str | Path, shape: str) -> Path:
    """models_dir/shape, written (random bf16 weights at SHAPES[shape], seed 0) if not there yet."""
    out = Path(models_dir) / shape
    if not (out / "model.safetensors").is_file():
        t0 = time.perf_counter()
        write_random_model(out, SHAPES[shape], dtype="bfloat16", seed=0)
        print(f"# wrote {shape} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out
