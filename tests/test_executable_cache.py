"""The executable cache (jaxinfer/executable_cache.py): a second engine on the same model loads every
step from it (no tracing, no lowering) and generates the same tokens; a corrupt entry is a miss, not
a failed start; the key follows the shapes, the settings and the source."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from conftest import without_jax_cache
from jaxinfer.runner.executable_cache import ExecutableCache

REPO = Path(__file__).resolve().parents[1]

# Each start is a process of its own, as a warm start is. (Within one process XLA:CPU can leave a
# kernel it compiled for an earlier executable out of a later one's serialized form: "Function
# broadcast_divide_fusion.1 not found" when loaded. The engine keeps the cache off on CPUs.)
CHILD = """
import json, sys
from jaxinfer import LLM
from jaxinfer.sampling import SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[3], max_num_seqs=2, max_model_len=128, max_num_batched_tokens=32,
          progress=False, cache_dir=sys.argv[2], executable_cache=True, compile_all_at_start=True,
          skip_tokenizer_init=True,
          **json.loads(sys.argv[4]))
params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)]
r = llm.engine.runner
ran, call = [], r._call
r._call = lambda v, batch: (ran.append(v.name), call(v, batch))[1]
out = [o.outputs[0].token_ids for o in llm.generate([[1, 403, 407, 261, 378], [1, 306, 102, 291]], params)]
if json.loads(sys.argv[4]):   # and a 25-token prompt alone: a one-sequence prompt step
    out += [o.outputs[0].token_ids for o in llm.generate([[1, 403, 407, 261, 378] * 5], params[:1])]
c = r.executable_cache
print(json.dumps(dict(tokens=out, ran=sorted(set(ran)), hits=c and c.hits, misses=c and c.misses,
                      steps=len(r.bucket_calls()), lower=r.warmup_breakdown["lower"])))
"""


def start_engine(model_dir, cache_dir, dtype: str = "float32", **options) -> tuple[dict, str]:
    """Start an engine in a new process with the executable cache at `cache_dir` ("" for none), generate
    two requests (greedy and seeded; with engine options, then a greedy one of 25 tokens alone): (its tokens, cache
    hits and misses, step count, lowering seconds; its stderr)."""
    p = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), str(cache_dir), dtype, json.dumps(options)],
                       capture_output=True,
                       text=True,
                       cwd=REPO, env=without_jax_cache({**os.environ, "PYTHONPATH": str(REPO)}), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_second_start_loads_every_step_and_generates_the_same(stories_dir, tmp_path):
    first, _ = start_engine(stories_dir, tmp_path)
    n = first["steps"]
    assert (first["hits"], first["misses"]) == (0, n)
    assert len(list((tmp_path / "executables").glob("*.exe"))) == n
    second, _ = start_engine(stories_dir, tmp_path)
    assert (second["hits"], second["misses"]) == (n, 0)
    assert second["lower"] == 0.0                 # nothing traced or lowered
    assert second["tokens"] == first["tokens"]
    uncached, _ = start_engine(stories_dir, "")
    assert uncached["tokens"] == first["tokens"]


def test_a_split_prompt_step_loads_both_parts(stories_dir, tmp_path):
    """A one-sequence prompt step as two executables (prompt_step_head_layers): a second start loads both parts
    (the cache holds one more entry than there are steps for each split step) and generates the same."""
    options = dict(greedy_mixed_step=True, fresh_prompt_attention=True, fresh_prompt_min_tokens=16,
                   prompt_step_head_layers=2, unroll_layers=True)
    first, _ = start_engine(stories_dir, tmp_path, **options)
    entries = len(list((tmp_path / "executables").glob("*.exe")))
    assert first["hits"] == 0 and first["misses"] == entries > first["steps"]
    second, _ = start_engine(stories_dir, tmp_path, **options)
    assert (second["hits"], second["misses"], second["lower"]) == (entries, 0, 0.0)
    assert second["tokens"] == first["tokens"] and "mixed-greedy-fresh" in second["ran"]


def test_a_corrupt_entry_is_a_miss(stories_dir, tmp_path):
    first, _ = start_engine(stories_dir, tmp_path)
    victim = sorted((tmp_path / "executables").glob("*.exe"))[0]
    victim.write_bytes(b"not a pickle")
    second, log = start_engine(stories_dir, tmp_path)
    assert "dropping unreadable" in log
    assert (second["hits"], second["misses"]) == (first["steps"] - 1, 1)
    assert victim.stat().st_size > 100            # compiled again and saved
    assert second["tokens"] == first["tokens"]


def test_key_follows_shapes_settings_and_names(tmp_path):
    cache = ExecutableCache(tmp_path)
    a = (jnp.zeros((4, 8), jnp.float32), {"b": np.zeros(3, np.int32)})
    k = cache.key("decode", "s", a)
    same_shapes = (jnp.ones((4, 8), jnp.float32), {"b": np.ones(3, np.int32)})
    assert k == cache.key("decode", "s", same_shapes)   # values don't matter
    assert k != cache.key("decode", "s", (jnp.zeros((4, 9), jnp.float32), a[1]))
    assert k != cache.key("decode", "s", (jnp.zeros((4, 8), jnp.bfloat16), a[1]))
    assert k != cache.key("decode", "s", (a[0], {"c": a[1]["b"]}))
    assert k != cache.key("decode", "t", a)
    assert k != cache.key("mixed", "s", a)


def test_a_code_change_is_a_new_key(tmp_path, monkeypatch):
    from jaxinfer.runner import executable_cache as ec

    cache = ExecutableCache(tmp_path)
    k = cache.key("decode", "s", ())
    monkeypatch.setattr(ec, "_source_digest", lambda: "another build")
    assert cache.key("decode", "s", ()) != k


def test_a_kernel_table_changed_at_run_time_is_a_new_key(tmp_path, monkeypatch):
    """A step reads the kernels' tables when it is traced: one traced with another table must not be loaded."""
    from jaxinfer.pallas import tables

    cache = ExecutableCache(tmp_path)
    k = cache.key("mixed", "s", ())
    monkeypatch.setattr(tables, "FRESH_PROMPT_FLASH", [])
    k2 = cache.key("mixed", "s", ())
    assert k2 != k
    monkeypatch.setitem(tables.HOPPER_GEMM, (1, 2, "none"), ((64, 64, tables.HopperConfig()),))
    assert cache.key("mixed", "s", ()) not in (k, k2)


def test_on_by_default_on_gpus_only():
    from jaxinfer.settings import EngineConfig

    assert EngineConfig().resolved("gpu", False).tuning.executable_cache is True
    assert EngineConfig().resolved("cpu", False).tuning.executable_cache is False
    assert EngineConfig.from_options(executable_cache=False).resolved("gpu", False).tuning.executable_cache is False


def test_the_folder_is_kept_under_its_size_least_recently_used_first(tmp_path):
    import os
    import time

    import jax

    x = jnp.zeros(5)
    compiled = jax.jit(lambda x: x * 2).lower(x).compile()
    cache = ExecutableCache(tmp_path, max_bytes=1)   # room for the newest file only
    keys = [cache.key("f", f"settings {i}", (x,)) for i in range(5)]   # same program, same file size
    for k in keys[:3]:
        cache.save(k, compiled)
    assert [p.stem for p in tmp_path.glob("*.exe")] == [keys[2]]
    cache.max_bytes = 1 << 30
    for i, k in enumerate(keys[:3]):
        cache.save(k, compiled)
        os.utime(tmp_path / f"{k}.exe", (time.time() - 100 + i,) * 2)     # keys[0] the least recent
    assert cache.load(keys[0]) is not None           # ... until loaded
    cache.max_bytes = 2 * (tmp_path / f"{keys[0]}.exe").stat().st_size
    cache.save(keys[3], compiled)
    assert sorted(p.stem for p in tmp_path.glob("*.exe")) == sorted([keys[0], keys[3]])   # the unused two went


def test_every_kernel_table_is_in_the_key(monkeypatch):
    """The kernels' measured tables live in pallas/tables.py, whose every upper-case name is part of the key: each
    one, changed, changes the key's part; and no kernel module holds a table of its own (a module-level list or
    dict the key would miss, letting a step traced with it changed at run time load one traced without)."""
    import importlib
    import pkgutil

    import jaxinfer.pallas
    from jaxinfer.pallas import tables
    from jaxinfer.runner.executable_cache import _kernel_choices

    def changed(value):
        if isinstance(value, dict):
            return {} if value else {(1, 1, "none"): "probe"}
        if isinstance(value, list):
            return [] if value else ["probe"]
        if isinstance(value, str):
            return value + "-probe"   # a kernel variant's name
        if value is None:
            return 1
        return value + 1    # ints: rows, tiling

    before, seen = _kernel_choices(), []
    for name, value in vars(tables).items():
        if name.isupper():
            with monkeypatch.context() as m:
                m.setattr(tables, name, changed(value))
                assert _kernel_choices() != before, f"tables.{name} is not in the executable cache's key"
            seen.append(name)
    assert len(seen) >= 10, seen
    for info in pkgutil.iter_modules(jaxinfer.pallas.__path__):
        module = importlib.import_module(f"jaxinfer.pallas.{info.name}")
        if module is not tables:
            own = [n for n, v in vars(module).items() if n.lstrip("_").isupper() and isinstance(v, (list, dict))]
            assert not own, f"{info.name} holds {own}: measured tables go in pallas/tables.py"
