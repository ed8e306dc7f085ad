"""The checkpoint reader's memory-mapped arrays equal what safetensors itself reads, for every dtype
a checkpoint may hold, across several files; loading assembles the same parameters either way."""

from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from conftest import DATA, STORIES
from jaxinfer.model.config import load_config
from jaxinfer.model.weights import RULES, CheckpointReader, _assemble, load_params


def test_memory_mapped_reads_equal_safetensors(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((7,)).astype(np.float16),
        "bf16": rng.standard_normal((4, 3, 2)).astype(ml_dtypes.bfloat16),
        "i64": rng.integers(-9, 9, (5,)),
        "i32": rng.integers(-9, 9, (2, 2)).astype(np.int32),
        "u8": rng.integers(0, 255, (9,)).astype(np.uint8),
        "empty": np.zeros((0, 4), np.float32),
        "scalar": np.asarray(3.5, np.float32),
    }
    names = list(arrays)
    save_file({k: arrays[k] for k in names[:4]}, tmp_path / "a.safetensors")
    save_file({k: arrays[k] for k in names[4:]}, tmp_path / "b.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {' + ", ".join(f'"{k}": "{"a" if i < 4 else "b"}.safetensors"' for i, k in enumerate(names))
        + "}}")
    reader = CheckpointReader(tmp_path)
    for k, want in arrays.items():
        got = reader.get(k)
        assert got.dtype == want.dtype and got.shape == want.shape, k
        np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
    assert set(reader._maps) == {"a.safetensors", "b.safetensors"}   # read through the maps
    with safe_open(str(tmp_path / "a.safetensors"), framework="np") as f:
        np.testing.assert_array_equal(reader.get("f32"), f.get_tensor("f32"))


def test_layers_filled_side_by_side_equal_one_by_one():
    cfg = load_config(STORIES)
    reader = CheckpointReader(STORIES)
    params = load_params(STORIES, cfg, progress=False)

    def read(name, shape, transpose):
        return reader.get(name)

    rule = next(r for r in RULES[cfg.family] if r.dest == "layers.w_gate_up")
    with ThreadPoolExecutor(4) as pool:
        parallel = _assemble(rule, cfg, read, np.float32, pool.map)
    np.testing.assert_array_equal(parallel, _assemble(rule, cfg, read, np.float32))
    np.testing.assert_array_equal(parallel, np.asarray(params["layers"]["w_gate_up"]))


def test_bench_model_writes_the_weights_whole_or_not_at_all(tmp_path):
    """bench_model writes a shape's folder once; the weights go to a partial file renamed when complete, so a run
    killed mid-write (a bench's time limit) leaves nothing a later run would take as written, and the later run
    writes them afresh. The folder loads through our loader."""
    from jaxinfer.model.config import load_config
    from bench.random_model import bench_model

    d = bench_model(tmp_path, "tiny")
    assert (d / "model.safetensors").is_file() and not (d / "model.safetensors.partial").exists()
    assert load_config(d, "bfloat16").num_layers == 2
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.partial").write_bytes(b"truncated")   # what a killed writer leaves
    bench_model(tmp_path, "tiny")
    assert (d / "model.safetensors").stat().st_size > 1000 and not (d / "model.safetensors.partial").exists()


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_layer_loading_equals_the_stacked_tree_split(family, dtype):
    """load_params(per_layer=True) (matrices sent per layer, joined and cast on the device) gives exactly
    split_layers of the stacked tree: the same tree, shapes, dtypes and values."""
    import jax

    from jaxinfer.model.transformer import split_layers

    d = DATA / "models" / family
    cfg = load_config(d, dtype)
    want = split_layers(load_params(d, cfg, progress=False))
    got = load_params(d, cfg, progress=False, per_layer=True)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
