"""float32 parity of the reference model with Hugging Face transformers (goldens in tests/data/golden,
made by tools/make_goldens.py)."""

import numpy as np
import pytest

from conftest import DATA
from jaxinfer.config import load_config
from jaxinfer.model import prompt_logits
from jaxinfer.ops import get_ops
from jaxinfer.weights import load_params

FAMILIES = ["llama2", "llama3", "mistral", "qwen2", "qwen3", "gpt2"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    d = DATA / "models" / request.param
    cfg = load_config(d)
    return request.param, cfg, load_params(d, cfg, progress=False)


def test_prompt_logits_match_transformers(family):
    name, cfg, params = family
    golden = np.load(DATA / "golden" / f"{name}.npz")
    for i in range(4):
        ours = np.asarray(prompt_logits(cfg, get_ops(), params, golden[f"prompt_{i}"]))
        want = golden[f"logits_{i}"]
        assert ours.shape == want.shape
        err = np.max(np.abs(ours - want))
        assert err <= 1e-4, f"{name} prompt {i}: max |logits - golden| = {err:.2e}"
