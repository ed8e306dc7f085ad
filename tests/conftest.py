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
