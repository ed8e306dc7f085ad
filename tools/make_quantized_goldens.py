"""Hugging Face transformers' logits of the tiny pre-quantized checkpoints (tools/make_quantized_checkpoints.py).

    .venv-ref/bin/python tools/make_quantized_goldens.py   # needs accelerate, compressed-tensors (--no-deps), loguru

writes tests/data/golden/quantized.npz: for each checkpoint, the float32 logits [T, V] of the token ids 3..T+2
(key: the folder's name; "ids": the ids). transformers 5.17 on the CPU reads the FP8 block format by dequantizing it
(no GPU) and the compressed-tensors ones by decompressing the weights; each is run with the input activations in
float32 (the activation quantization of a W8A8 scheme switched off: jaxinfer reads such checkpoints weight-only).
Deterministic: rerunning leaves `git status` clean.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("qwen3-fp8-block", "qwen3-w8a8-int8", "qwen3-fp8-dynamic")
IDS = np.arange(3, 40)


def without_activation_quantization(model: torch.nn.Module) -> None:
    """compressed-tensors attaches each W8A8 module's input quantization as `quantization_scheme.input_activations`
    and applies it in a forward hook; dropping the scheme's activation part leaves the weights alone."""
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and getattr(scheme, "input_activations", None) is not None:
            scheme.input_activations = None


def main() -> None:
    out = {"ids": IDS.astype(np.int32)}
    for name in MODELS:
        model = AutoModelForCausalLM.from_pretrained(ROOT / "tests/data/models" / name, dtype=torch.float32)
        without_activation_quantization(model)
        model.eval()
        with torch.no_grad():
            out[name] = model(torch.as_tensor(IDS)[None]).logits[0].float().numpy()
        print(f"{name}: {type(model.model.layers[0].self_attn.q_proj).__name__}, logits {out[name].shape}")
    np.savez(ROOT / "tests/data/golden/quantized.npz", **out)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
