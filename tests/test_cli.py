"""The CLI end to end: chat loops (plain continuation on a model without a chat template)."""

import dataclasses
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
    from conftest import write_tiny_qwen3

    d = write_tiny_qwen3(tmp_path, max_position_embeddings=256)
    r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "chat", "--model", str(d), "--max-tokens", "5"],
                       input="Hello!\nAnd again?\n/exit\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[chat template;" in r.stderr
    assert r.stdout.count("> ") == 3


@pytest.mark.parametrize("like_serve", [False, True])
def test_bench_prints_latency_and_throughput(like_serve):
    r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "bench", "--model", str(STORIES), "--input-len", "16",
                        "--output-len", "8", "--max-num-seqs", "4", "--num-prompts", "8"]
                       + ["--like-serve"] * like_serve, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "single request: 16 prompt + 8 new tokens" in r.stdout and "decode" in r.stdout
    assert "throughput: 8 requests, up to 4 at once" in r.stdout and "output tok/s" in r.stdout
    assert "of the wall time prefill steps" in r.stdout
    shares = dict(re.findall(r"(\w+) (\d+\.\d)%", r.stdout.split("engine phases, share of the wall time:")[1]))
    assert set(shares) == {"schedule", "build", "run", "append", "settle", "chain", "collect"}
    assert 0 < sum(float(v) for v in shares.values()) <= 100.5


def test_bench_rejects_bad_sizes():
    r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "bench", "--model", str(STORIES), "--num-prompts", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "must be >= 1" in r.stderr and "Traceback" not in r.stderr


def _run(*args: str, **kw):
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", *args], capture_output=True, text=True, timeout=300,
                          **kw)


def test_help_shows_every_flag_with_its_default_and_choices():
    from jaxinfer.cli import build_parser
    from jaxinfer.settings import EngineConfig, ServerConfig

    text = _run("serve", "--help").stdout
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag", True):
                assert "--" + f.name.replace("_", "-") in text, f.name
    assert "--dtype {auto,float32,bfloat16,float16}" in text and "--ops {auto,pallas,reference,pallas-interpret}" in text
    assert "(default: 256)" in text and "(default: auto)" in text
    # generate and chat run one sequence: no batch-size flag to misread
    assert "--max-num-seqs" not in _run("generate", "--help").stdout
    assert build_parser().parse_args(["generate", "--model", "m", "x"]).model == "m"


def test_version_and_a_required_model():
    from jaxinfer import __version__

    assert _run("--version").stdout.strip() == f"jaxinfer {__version__}"
    r = _run("generate", "hi")
    assert r.returncode == 2 and "--model" in r.stderr and "Traceback" not in r.stderr


def test_tuning_switches_are_checked_by_name():
    from jaxinfer.cli import parse_tuning

    assert parse_tuning(["overlap_mixed=false", "token_buckets=16,32", "chain_early_ms=0.5"]) == \
        {"overlap_mixed": False, "token_buckets": (16, 32), "chain_early_ms": 0.5}
    r = _run("generate", "--model", str(STORIES), "--tuning", "overlap_mixd=true", "hi")
    assert r.returncode == 2 and "overlap_mixd" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_generate_rejects_more_tokens_than_the_context_as_the_server_does():
    r = _run("generate", "--model", str(STORIES), "--max-tokens", "600", "Once upon a time")
    assert r.returncode == 2 and "maximum context length is 512 tokens" in r.stderr and r.stdout == ""


def test_unseeded_sampling_differs_between_runs_and_a_seed_repeats():
    args = ("generate", "--model", str(STORIES), "--max-tokens", "40", "--temperature", "1.0", "Once upon a time")
    unseeded = {_run(*args).stdout for _ in range(2)}
    seeded = {_run(*args, "--seed", "7").stdout for _ in range(2)}
    assert len(unseeded) == 2 and len(seeded) == 1


def test_no_progress_bars_when_stderr_is_not_a_terminal():
    r = _run("generate", "--model", str(STORIES), "--max-tokens", "5", "Once")
    assert r.returncode == 0 and "\r" not in r.stderr and r.stderr.count("[jaxinfer:") == 1
