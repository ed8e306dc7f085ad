"""Shared paths for the tests (../shared beside the checkout, the repo's own test data) and the kernel
tests' error measure."""

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DATA = REPO / "tests" / "data"
STORIES = SHARED / "models" / "stories260k"
TOKENIZERS = SHARED / "tokenizers"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    assert STORIES.is_dir(), f"missing {STORIES}: ../shared must sit beside the checkout"
    return STORIES


def rel_err(y, ref) -> float:
    """Relative Frobenius error of a kernel's output against its reference twin, in float64; a
    non-finite output (unwritten or masked-in garbage) fails at once."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(y)), "non-finite output (unwritten or masked-in garbage)"
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)
