"""The executable cache (jaxinfer/executable_cache.py): a second engine on the same model loads every
step from it (no tracing, no lowering) and generates the same tokens; a corrupt entry is a miss, not
a failed start; the key follows the shapes, the settings and the source."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine import LLM
from jaxinfer.executable_cache import ExecutableCache
from jaxinfer.sampling import SamplingParams

PROMPTS = [[1, 403, 407, 261, 378], [1, 306, 102, 291]]


def _engine(model_dir, cache_dir, **kw):
    return LLM(model_dir, dtype="float32", max_num_seqs=2, max_model_len=128, max_num_batched_tokens=32,
                  progress=False, compilation_cache=None, executable_cache=str(cache_dir) if cache_dir else None, **kw)


def _generate(engine):
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)]
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


def test_second_start_loads_every_step_and_generates_the_same(stories_dir, tmp_path):
    first = _engine(stories_dir, tmp_path)
    n_steps = len(first.engine.runner.bucket_calls())
    assert first.engine.runner.executable_cache.misses == n_steps and first.engine.runner.executable_cache.hits == 0
    assert len(list(tmp_path.glob("*.exe"))) == n_steps
    want = _generate(first)
    del first
    second = _engine(stories_dir, tmp_path)
    assert second.engine.runner.executable_cache.hits == n_steps and second.engine.runner.executable_cache.misses == 0
    assert second.engine.runner.warmup_breakdown["lower"] == 0.0
    assert _generate(second) == want
    assert _generate(_engine(stories_dir, None)) == want


def test_a_corrupt_entry_is_a_miss(stories_dir, tmp_path):
    want = _generate(_engine(stories_dir, tmp_path))
    victim = sorted(tmp_path.glob("*.exe"))[0]
    victim.write_bytes(b"not a pickle")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine(stories_dir, tmp_path)
    assert any("unreadable" in str(w.message) for w in caught)
    assert engine.engine.runner.executable_cache.misses == 1
    assert victim.stat().st_size > 100   # compiled again and saved
    assert _generate(engine) == want


def test_key_follows_shapes_settings_and_names(tmp_path):
    cache = ExecutableCache(tmp_path)
    a = (jnp.zeros((4, 8), jnp.float32), {"b": np.zeros(3, np.int32)})
    k = cache.key("decode", "s", a)
    assert k == cache.key("decode", "s", (jnp.ones((4, 8), jnp.float32), {"b": np.ones(3, np.int32)}))  # values don't matter
    assert k != cache.key("decode", "s", (jnp.zeros((4, 9), jnp.float32), a[1]))
    assert k != cache.key("decode", "s", (jnp.zeros((4, 8), jnp.bfloat16), a[1]))
    assert k != cache.key("decode", "s", (a[0], {"c": a[1]["b"]}))
    assert k != cache.key("decode", "t", a)
    assert k != cache.key("mixed", "s", a)


def test_a_code_change_is_a_new_key(tmp_path, monkeypatch):
    from jaxinfer import executable_cache as ec

    cache = ExecutableCache(tmp_path)
    k = cache.key("decode", "s", ())
    monkeypatch.setattr(ec, "_source_digest", lambda: "another build")
    assert cache.key("decode", "s", ()) != k


def test_on_by_default_on_gpus_only():
    from jaxinfer.engine import EngineConfig

    assert EngineConfig().for_backend("gpu").executable_cache.endswith("executables")
    assert EngineConfig().for_backend("cpu").executable_cache == ""
    assert EngineConfig(executable_cache="").for_backend("gpu").executable_cache == ""
