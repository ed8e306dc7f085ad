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
# Mixtures of experts: 61 GB and 93 GB in bf16. A shape name "NAME@N" takes its first N layers (bench_model), so
# that the model and the transformers peer fit one GPU (and its disk) side by side; per layer nothing changes.
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643,
                     eos_token_id=151645, hidden_act="silu")
MIXTRAL_8X7B = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                    num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768, rms_norm_eps=1e-5,
                    rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, bos_token_id=1,
                    eos_token_id=2, hidden_act="silu")
# A 2-layer, 64-wide Qwen3-MoE (8 experts, 2 active): the MoE benchmarks' CPU smoke runs.
TINY_MOE = {**QWEN3_30B_A3B, "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
            "num_experts_per_tok": 2, "max_position_embeddings": 8192}
# Dense families beside Llama's layout (shapes as their config.json files give them; Phi-4-mini's LongRoPE factors
# here are placeholders of the right length, not the published ones).
PHI4_MINI = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=200064, hidden_size=3072,
                 num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192,
                 max_position_embeddings=131072, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                 rope_theta=10000.0, rope_scaling=dict(type="longrope", short_factor=[1.0] * 48,
                                                       long_factor=[1.0 + i / 8 for i in range(48)]),
                 rms_norm_eps=1e-5, sliding_window=262144, tie_word_embeddings=True, bos_token_id=199999,
                 eos_token_id=199999, hidden_act="silu")
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
                 num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 intermediate_size=6912, max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
                 sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106],
                 hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None)
APERTUS_8B = dict(architectures=["ApertusForCausalLM"], model_type="apertus", vocab_size=131072, hidden_size=4096,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=21504,
                  max_position_embeddings=65536, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="xielu",
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192), rope_theta=12000000.0,
                  bos_token_id=1, eos_token_id=2)
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-4b": QWEN3_4B, "llama3-8b": LLAMA3_8B, "tiny": TINY,
          "qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B, "tiny-moe": TINY_MOE}
SHAPES.update({"phi4-mini": PHI4_MINI, "gemma3-1b": GEMMA3_1B, "apertus-8b": APERTUS_8B})
# Llama-3-70B (141 GB in bf16): tensor parallelism's large shape (issue 41); "llama3-70b@N" for the first N layers
# where a machine's disk cannot hold the whole model.
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 28672}
SHAPES["llama3-70b"] = LLAMA3_70B


XIELU_INIT = {"alpha_p": float(np.log(np.expm1(0.8))), "alpha_n": float(np.log(np.expm1(0.3))), "beta": 0.5,
              "eps": -1e-6}


def shape_config(shape: str) -> dict[str, Any]:
    """SHAPES[name] for "name", or its first N layers for "name@N"."""
    name, _, layers = shape.partition("@")
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} ({', '.join(SHAPES)})")
    return {**SHAPES[name], **({"num_hidden_layers": int(layers)} if layers else {})}


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
        experts = cfg.num_experts if rule.per_expert else 0   # a layer's experts drawn at once, [E, ...]
        for src, shape in zip(rule.sources, rule.shapes(cfg)):
            for i in layers:
                key, sub = jax.random.split(key)
                if src.endswith(("norm.weight", "layernorm.weight")) or ".ln_" in src:
                    value = jnp.ones(shape, jnp.float32)
                elif ".act_fn." in src:   # xIELU's alpha_p, alpha_n, beta, eps as transformers initialises them
                    value = jnp.full(shape, XIELU_INIT[src.rsplit(".", 1)[1]], jnp.float32)
                else:
                    value = std * jax.random.normal(sub, (experts, *shape) if experts else shape, jnp.float32)
                if rule.transpose and len(shape) == 2:
                    value = value.T
                value = np.asarray(value.astype(dtype)).astype(np_dtype)
                for e in range(experts):
                    tensors[prefix + src.format(i=i, e=e)] = value[e]
                if not experts:
                    tensors[prefix + src.format(i=i)] = value
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
    """models_dir/shape, written (random bf16 weights at shape_config(shape), seed 0) if not there yet."""
    out = Path(models_dir) / shape
    if not (out / "model.safetensors").is_file():
        t0 = time.perf_counter()
        write_random_model(out, shape_config(shape), dtype="bfloat16", seed=0)
        print(f"# wrote {shape} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out
