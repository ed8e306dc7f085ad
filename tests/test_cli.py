"""The CLI end to end: chat loops (plain continuation on a model without a chat template)."""

import re
import subprocess
import sys

import pytest

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


def test_chat_with_template_on_random_qwen3(tmp_path):
    """A tiny random Qwen3 with the real Qwen3 tokenizer: the chat loop goes through its template."""
    from conftest import TOKENIZERS
    from bench.random_model import QWEN3_0_6B, write_random_model

    tiny = {**QWEN3_0_6B, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 256}
    d = write_random_model(tmp_path / "qwen3", tiny, dtype="float32", tokenizer_dir=TOKENIZERS / "qwen3")
    r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "chat", "--model", str(d), "--max-tokens", "5"],
                       input="Hello!\nAnd again?\n/exit\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[chat template;" in r.stderr
    assert r.stdout.count("> ") == 3


@pytest.mark.parametrize("like_serve", [False, True])
def test_bench_prints_latency_and_throughput(like_serve):
    r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "bench", "--model", str(STORIES), "--input-len", "16",
                        "--output-len", "8", "--batch-size", "4", "--num-prompts", "8"]
                       + ["--like-serve"] * like_serve, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "single request: 16 prompt + 8 new tokens" in r.stdout and "decode" in r.stdout
    assert "throughput: 8 requests at batch 4" in r.stdout and "output tok/s" in r.stdout
    assert "of the wall time prefill steps" in r.stdout
    shares = dict(re.findall(r"(\w+) (\d+\.\d)%", r.stdout.split("engine phases, share of the wall time:")[1]))
    assert set(shares) == {"schedule", "build", "run", "append", "settle", "chain", "collect"}
    assert 0 < sum(float(v) for v in shares.values()) <= 100.5


def test_bench_rejects_bad_sizes():
    r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "bench", "--model", str(STORIES), "--batch-size", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "must be >= 1" in r.stderr and "Traceback" not in r.stderr
