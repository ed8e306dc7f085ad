"""Tiny pre-quantized checkpoints in the published formats, from the float32 tests/data/models/qwen3.

    .venv/bin/python tools/make_quantized_checkpoints.py

writes (deterministic; rerunning leaves `git status` clean):
- tests/data/models/qwen3-fp8-block: the official Qwen3 FP8 format. config.json `quantization_config`
  {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}; every linear
  layer's `*.weight` in float8_e4m3fn with `*.weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)]
  (scale = max |w| of the block / 448; weight = w / scale, rounded by the cast). The tiny model's k/v
  projections have 64 rows: partial blocks, which the loader regrids when it joins q, k and v.
- tests/data/models/qwen3-w8a8-int8: compressed-tensors `int-quantized` as llm-compressor writes its W8A8
  scheme: int8 `*.weight`, `*.weight_scale` [out, 1] per channel (symmetric: scale = max |w_row| / 127.5, values
  rounded and clamped to [-128, 127]), dynamic per-token int8 input activations, lm_head ignored.
- tests/data/models/qwen3-fp8-dynamic: compressed-tensors `float-quantized` (llm-compressor's FP8_DYNAMIC):
  float8_e4m3fn `*.weight`, `*.weight_scale` [out, 1] (max |w_row| / 448), dynamic per-token fp8 activations.
- tests/data/models/qwen3_moe-fp8-block: the official Qwen3 FP8 format on the tiny Qwen3-MoE (the attention's and
  every expert's matrices; the router stays float32, as in Qwen3-30B-A3B-FP8), blocks of 16 x 16 so that the tiny
  matrices hold several (the published checkpoints' 128 x 128 would be one block a matrix here).
Embeddings and norms stay float32, as the float model's. Uses numpy only (no torch).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests/data/models/qwen3"
OUT = ROOT / "tests/data/models"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = ml_dtypes.float8_e4m3fn


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in LINEAR)


def fp8_block(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8 values, float32 weight_scale_inv [ceil(out / bo), ceil(in / bi)])."""
    bo, bi = block
    out, inp = w.shape
    nbo, nbi = -(-out // bo), -(-inp // bi)
    padded = np.zeros((nbo * bo, nbi * bi), np.float32)
    padded[:out, :inp] = w
    amax = np.abs(padded.reshape(nbo, bo, nbi, bi)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:out, :inp]
    return np.clip(w / full, -448, 448).astype(FP8), scale


def int8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.5, 1.0).astype(np.float32)
    return np.clip(np.round(w / scale), -128, 127).astype(np.int8), scale


def fp8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    return np.clip(w / scale, -448, 448).astype(FP8), scale


def compressed_tensors_config(kind: str) -> dict:
    args = dict(num_bits=8, type=kind, symmetric=True, group_size=None, actorder=None, block_structure=None,
                observer_kwargs={})
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if kind == "int" else "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**args, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**args, "strategy": "token", "dynamic": True, "observer": None},
            "output_activations": None,
        }},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "version": "0.9.4",
    }


def write(name: str, quantization_config: dict, quantize_one, scale_suffix: str, source: Path = SOURCE) -> None:
    dest = OUT / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir()
    tensors = {}
    for key, w in sorted(load_file(source / "model.safetensors").items()):
        if is_linear(key):
            values, scale = quantize_one(w.astype(np.float32))
            tensors[key] = values
            tensors[key.removesuffix("weight") + scale_suffix] = scale
        else:
            tensors[key] = w
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (source / "generation_config.json").exists():
        shutil.copy(source / "generation_config.json", dest / "generation_config.json")
    print(f"{dest.relative_to(ROOT)}: {(dest / 'model.safetensors').stat().st_size:,} bytes")


def main() -> None:
    write("qwen3-fp8-block", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]},
          lambda w: fp8_block(w, (128, 128)), "weight_scale_inv")
    write("qwen3-w8a8-int8", compressed_tensors_config("int"), int8_channel, "weight_scale")
    write("qwen3-fp8-dynamic", compressed_tensors_config("float"), fp8_channel, "weight_scale")
    write("qwen3_moe-fp8-block", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [16, 16]},
          lambda w: fp8_block(w, (16, 16)), "weight_scale_inv", OUT / "qwen3_moe")


if __name__ == "__main__":
    main()
