"""The executable cache on the GPU: a second start of the engine loads every step (Pallas Triton
kernels included, layers unrolled as on GPUs) and generates the tokens of the first start."""

from pathlib import Path

import pytest

from bench.random_model import QWEN3_0_6B, write_random_model
from tests.test_executable_cache import start_engine

REPO = Path(__file__).resolve().parents[2]
STORIES = next((p for p in (REPO / ".carry" / "stories260k", REPO.parent / "shared" / "models" / "stories260k")
                if p.is_dir()), None)
QWEN3_SMALL = {**QWEN3_0_6B, "num_hidden_layers": 4, "max_position_embeddings": 1024}


@pytest.mark.parametrize("which", ["stories", "qwen3"])
def test_second_start_loads_every_step_and_generates_the_same(which, tmp_path):
    if which == "stories":
        model, dtype = STORIES, "float32"
    else:
        model, dtype = write_random_model(tmp_path / "qwen3", QWEN3_SMALL, dtype="bfloat16", std=0.05), "bfloat16"
    first, _ = start_engine(model, tmp_path / "exe", dtype)
    second, _ = start_engine(model, tmp_path / "exe", dtype)
    assert (first["hits"], first["misses"]) == (0, first["steps"])
    assert (second["hits"], second["misses"]) == (first["steps"], 0)
    assert second["tokens"] == first["tokens"]
