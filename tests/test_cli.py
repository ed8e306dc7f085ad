"""The CLI end to end: chat loops (plain continuation on a model without a chat template)."""

import subprocess
import sys

from conftest import STORIES


def _chat(stdin: str):
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", "chat", "--model", str(STORIES), "--max-tokens", "20",
                           "--temperature", "0"], input=stdin, capture_output=True, text=True, timeout=300)


def test_chat_plain_continuation_then_exit():
    r = _chat("Once upon a time\n/exit\nnever read\n")
    assert r.returncode == 0, r.stderr
    assert "no chat template" in r.stderr
    assert ", there was a little girl named Lily" in r.stdout


def test_chat_leaves_on_end_of_input():
    r = _chat("One day\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 2  # one prompt answered, then Ctrl-D at the second
