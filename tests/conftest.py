"""Shared paths for the tests: ../shared beside the checkout, and the repo's own test data."""

from pathlib import Path

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
