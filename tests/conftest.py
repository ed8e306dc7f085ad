"""Shared paths for the tests (../shared beside the checkout, the repo's own test data), the kernel
tests' error measure, a tiny Qwen3 with the real tokenizer, and two engine-test probes (nothing compiled in a
block; which steps ran)."""

import contextlib
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DATA = REPO / "tests" / "data"
STORIES = SHARED / "models" / "stories260k"
TOKENIZERS = SHARED / "tokenizers"


# JAX's persistent compilation cache from each test process's first compile, its subprocesses' too (the tensor-parallel
# workers, the bench scripts, the CLI's). The engine already turns it on (min compile time 0) at ~/.cache/jaxinfer/jax
# on a CPU, but only once an Engine starts with the default cache_dir, so a process that passes cache_dir="" or compiles
# before its first Engine compiled everything afresh on every run. The cache holds XLA's executables keyed by the
# lowered module, the compile options and the versions: what runs is what a fresh compile gives (one loaded back
# also records backend_compile_duration, as a fresh compile does). A warm machine (a second run) loads them; a fresh
# one shares them between the run's processes. Not with the executable cache (tests/test_executable_cache.py's
# children drop it, as the engine keeps JAX's off there), nor on GPUs, nor over a JAX_COMPILATION_CACHE_DIR set.
if jax.default_backend() == "cpu" and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    from jaxinfer.settings import CACHE_DIR

    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(CACHE_DIR, "jax")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def without_jax_cache(env: dict) -> dict:
    """`env` for a child that must not use JAX's persistent compilation cache (above)."""
    return {k: v for k, v in env.items() if k not in ("JAX_COMPILATION_CACHE_DIR",
                                                      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}


def pytest_runtest_logreport(report):
    """With JAXINFER_PRINT_FAILURES=1 (GPU rounds), a failure is printed as it happens: a run killed at its
    time limit loses pytest's closing summary."""
    if report.failed and os.environ.get("JAXINFER_PRINT_FAILURES"):
        print(f"\nFAILED {report.nodeid}\n{report.longreprtext}", flush=True)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    assert STORIES.is_dir(), f"missing {STORIES}: ../shared must sit beside the checkout"
    return STORIES


def write_tiny_qwen3(folder: Path, max_position_embeddings: int) -> Path:
    """A one-layer random float32 Qwen3 (32 wide) with the real Qwen3 tokenizer and chat template, in `folder`."""
    from bench.random_model import QWEN3_0_6B, write_random_model

    tiny = {**QWEN3_0_6B, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
            "max_position_embeddings": max_position_embeddings}
    return write_random_model(folder / "qwen3-tiny", tiny, dtype="float32", tokenizer_dir=TOKENIZERS / "qwen3")


def rel_err(y, ref) -> float:
    """Relative Frobenius error of a kernel's output against its reference twin, in float64; a
    non-finite output (unwritten or masked-in garbage) fails at once."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(y)), "non-finite output (unwritten or masked-in garbage)"
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


def poisoned_outside(k, v, page_table, page_size: int, visible_lens):
    """k, v caches [L, KVH, slots, hd] with every slot but the first visible_lens[b] positions of each sequence b's
    pages (page_table [B, P]) set to NaN or +-inf: an attention kernel that reads a slot it should not shows it."""
    slots = np.asarray(page_table)[:, :, None] * page_size + np.arange(page_size)
    visible = np.zeros(k.shape[2], bool)
    for b, n in enumerate(visible_lens):
        visible[slots[b].reshape(-1)[:n]] = True
    poison = jnp.asarray(np.where(np.arange(k.shape[2]) % 2 == 0, np.nan, np.inf).astype(np.float32))
    mask = jnp.asarray(visible)[None, None, :, None]
    return jnp.where(mask, k, poison[None, None, :, None]), jnp.where(mask, v, -poison[None, None, :, None])


@contextlib.contextmanager
def no_compiles():
    """Fails if anything is traced or compiled inside the block."""
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: events.append(event) if "compile" in event or "trace" in event else None)
    try:
        yield
    finally:
        jax.monitoring.clear_event_listeners()
    assert events == []


def record_steps(runner, what=lambda variant, batch: variant.name) -> list:
    """The compiled steps the runner calls from now on, in order: what(variant, batch) of each (by default
    the variant's name, e.g. "decode-greedy-8")."""
    ran = []
    call = runner._call
    runner._call = lambda variant, batch: (ran.append(what(variant, batch)), call(variant, batch))[1]
    return ran


def moe_block(T: int, D: int, I: int, E: int, top_k: int, seed: int):
    """A mixture-of-experts block's operands in bf16: x [T, D], the router [E, D], two layers of gate/up [2, E, 2I, D]
    and down [2, E, D, I] stacks read at layer 1 (LayerWeights, a layer of a deeper stack read in place), and the
    reference block's float32 output on them (the residual added)."""
    from jaxinfer.ops import LayerWeight, reference

    bf16 = jnp.bfloat16
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (T, D), jnp.float32).astype(bf16)
    router = (jax.random.normal(ks[1], (E, D)) / np.sqrt(D)).astype(bf16)
    w_gu = (jax.random.normal(ks[2], (2, E, 2 * I, D)) / np.sqrt(D)).astype(bf16)
    w_dn = (jax.random.normal(ks[3], (2, E, D, I)) / np.sqrt(I)).astype(bf16)
    layer = jnp.int32(1)
    want = np.asarray(reference.moe_mlp(x, router, w_gu[1], w_dn[1], top_k, True, residual=x), np.float32)
    return (x, LayerWeight(router[None], jnp.int32(0)), LayerWeight(w_gu, layer), LayerWeight(w_dn, layer), want,
            (router, w_gu, w_dn, layer))
