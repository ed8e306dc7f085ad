"""Tensor parallelism on the CPU: 8 host devices in a process of its own (tests/tensor_parallel_worker.py), so
that the other tests keep one device. TP 2, 4 and 8 against TP 1: the same logits in float32, for every family
(the tiny models have 4 heads and 2 or 4 KV heads, so TP 8 holds heads in groups; their vocabularies and MLP widths
do not all divide by 8); the greedy tokens of TP 8 (and of the Pallas kernels in interpret mode at TP 2) against
the golden files, which TP 1 matches (test_engine); two processes through jax.distributed, running the same generate or following process 0's engine calls; the layout; the
errors."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.model.config import load_config
from jaxinfer.model.tensor_parallel import TensorParallelError, check, local_config, order
from jaxinfer.runner.mesh import make_mesh

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "tensor_parallel_worker.py"
MODELS = REPO / "tests" / "data" / "models"
GOLDEN_FAMILIES = ["llama2", "llama3", "mistral", "qwen2", "qwen3", "gpt2"]
FAMILIES = GOLDEN_FAMILIES + ["stories260k"]


def run_worker(*args: str, devices: int = 8, timeout: int = 600) -> list[dict]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
    out = subprocess.run([sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_logits_equal_tp1_for_every_family():
    rows = run_worker("logits", *FAMILIES)
    assert {(r["family"], r["n"]) for r in rows} == {(f, n) for f in FAMILIES for n in (2, 4, 8)}
    for r in rows:
        assert r["shape"] == r["ref_shape"], r   # padded vocabulary cut back
        assert r["sharded"] > 0, r
        assert r["max_abs"] < 1e-4, r
        assert r["argmax_equal"], r


def golden_tokens(family: str) -> list[list[int]]:
    golden = np.load(REPO / "tests" / "data" / "golden" / f"{family}.npz")
    return [golden[f"greedy_{i}"][:16].tolist() for i in range(4)]   # TP 1's (test_engine checks it)


@pytest.mark.parametrize("ops,n,family", [("reference", 8, f) for f in GOLDEN_FAMILIES] +
                         [("pallas-interpret", 2, "qwen3")])
def test_greedy_tokens_equal_tp1(ops, n, family):
    rows = run_worker("greedy", ops, str(n), family)
    assert [r["family"] for r in rows] == [family]
    assert rows[0]["tokens"] == golden_tokens(family)


def test_sampling_speculation_int8_cache_and_split_layers_equal_tp1():
    rows = run_worker("settings")
    assert [r["n"] for r in rows] == [1, 2]
    assert all(len(t) == 16 for t in rows[0]["tokens"])
    assert rows[1]["tokens"] == rows[0]["tokens"]


def run_two_processes(mode: str) -> list[list[dict]]:
    """The worker's `mode` in two processes on localhost (jax.distributed, one CPU device each, gloo)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode, str(rank), "2", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out, _ in outs]


def test_two_processes_give_the_tokens_of_one():
    """Both processes run the same generate: TP 2 across the two."""
    for rows in run_two_processes("distributed"):
        assert rows and rows[0]["n"] == 2 and rows[0]["tokens"] == golden_tokens("qwen3")


def test_process_zero_leads_and_the_other_follows():
    """Process 0 alone schedules (two batches, one after the other); process 1 makes its engine calls after it."""
    lead, follow = run_two_processes("follower")
    assert lead[0]["tokens"] == golden_tokens("qwen3")
    assert follow[0]["calls"] > 8   # four requests added, steps, outputs taken


def test_qkv_rows_are_each_devices_heads():
    cfg = load_config(MODELS / "llama3")   # 4 heads, 2 KV heads, head_dim 16
    q, kv, hd = cfg.q_size, cfg.kv_size, cfg.head_dim
    rows = order("qkv", cfg, 4, [q, kv, kv]).reshape(4, -1)   # a device's block: one q head, its KV head
    for d in range(4):
        kv_head = d // 2
        want = np.concatenate([d * hd + np.arange(hd), q + kv_head * hd + np.arange(hd),
                               q + kv + kv_head * hd + np.arange(hd)])
        np.testing.assert_array_equal(rows[d], want)
    cols = order("heads", cfg, 8, [q]).reshape(8, -1)   # 8 devices, 4 heads: the second of each pair holds zeros
    assert (cols[1::2] == -1).all() and (cols[0::2] >= 0).all()
    gate_up = order("out", cfg, 8, [cfg.intermediate_size] * 2)   # 176 = 8 * 22: no padding; gate then up
    assert sorted(gate_up) == list(range(2 * cfg.intermediate_size))
    assert local_config(cfg, 8).num_heads == 1 and local_config(cfg, 8).num_kv_heads == 1


def test_padding_of_a_width_that_does_not_divide():
    cfg = load_config(MODELS / "llama2")   # intermediate 172: 22 a device of 8, the last 4 rows zeros
    rows = order("out", cfg, 8, [cfg.intermediate_size])
    assert len(rows) == 176 and (rows == -1).sum() == 4
    assert sorted(rows[rows >= 0]) == list(range(172))


def test_bad_sizes_are_one_clear_error():
    cfg = load_config(MODELS / "llama3")
    with pytest.raises(TensorParallelError, match="does not fit the model's 4 attention heads"):
        check(cfg, 3)
    with pytest.raises(TensorParallelError, match="needs 4096 devices"):
        make_mesh(4096)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        from jaxinfer import LLM

        LLM(MODELS / "llama3", tensor_parallel_size=0, skip_tokenizer_init=True, progress=False)


def test_unsupported_combinations_are_one_clear_error():
    from jaxinfer import LLM

    for settings, message in ((dict(quantization="int8"), "8-bit weights"),
                              (dict(speculative="draft:x"), "n-gram speculation only")):
        with pytest.raises(TensorParallelError, match=message):
            LLM(MODELS / "llama3", tensor_parallel_size=2, skip_tokenizer_init=True, progress=False, **settings)


def test_benches_run_at_tp2_on_the_cpu(tmp_path):
    """bench/collectives.py and bench/decode.py --tensor-parallel-size end to end on 2 host devices (their figures
    here mean nothing: a GPU session's minutes are not lost to a script error)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    for args in (["collectives.py", "--cpu", "--tp", "2", "--batches", "1", "--widths", "256", "--layers", "2",
                  "--iters", "2"],
                 ["decode.py", "--shapes", "tiny", "--long", "--paths", "reference", "--prompt", "24", "--new", "6",
                  "--steps", "3", "--models", str(tmp_path / "models"), "--tensor-parallel-size", "2"]):
        r = subprocess.run([sys.executable, str(REPO / "bench" / args[0]), *args[1:], "--out", str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=300, cwd=REPO)
        assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "collectives.json").read_text())
    assert [(r["tp"], r["batch"], r["width"]) for r in rows] == [(2, 1, 256)]
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert "error" not in json.dumps(decode) and "step_ms" in json.dumps(decode)
