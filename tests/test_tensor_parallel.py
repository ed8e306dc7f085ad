"""Tensor parallelism on the CPU: 8 host devices in a process of its own (tests/tensor_parallel_worker.py), so
that the other tests keep one device. TP 2, 4 and 8 against TP 1: the same logits in float32, for every family
(the tiny models have 4 heads and 2 or 4 KV heads, so TP 8 holds heads in groups; their vocabularies and MLP widths
do not all divide by 8); the greedy tokens of TP 8 (and of the Pallas kernels in interpret mode at TP 2) against
the golden files, which TP 1 matches (test_engine, test_dense_families); the engine's features (prefix cache,
preemption, structured output, penalties, logprobs, 8-bit caches) and the commands at TP 2 against TP 1; two
processes through jax.distributed, running the same generate or following process 0's engine calls; the layout; the
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
from jaxinfer.model.weights import RULES
from jaxinfer.runner.mesh import make_mesh

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "tensor_parallel_worker.py"
MODELS = REPO / "tests" / "data" / "models"
GOLDEN_FAMILIES = ["llama2", "llama3", "mistral", "qwen2", "qwen3", "gpt2"]
# every dense family tensor parallelism takes: fused q/k/v and gate/up (Phi-3, Phi-4-mini: partial rotary), xIELU
# (Apertus), sliding windows shorter than the prompts (Mistral, Qwen2), Gemma 3's normed block outputs (and its
# per-layer windows cut to bite: the worker's gemma3_windows); the mixtures of experts (Qwen3-MoE, Mixtral; and
# Qwen3-MoE's experts cut to 27 rows, padded on every device count)
MOE_FAMILIES = ["qwen3_moe", "mixtral"]
FAMILIES = GOLDEN_FAMILIES + ["stories260k", "phi3", "phi4_mini", "apertus", "mistral_swa", "qwen2_swa", "gemma3",
                              "gemma3_windows"] + MOE_FAMILIES + ["qwen3_moe_27"]


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


@pytest.mark.parametrize("ops,n,family", [("reference", 8, f) for f in GOLDEN_FAMILIES + ["gemma3"] + MOE_FAMILIES] +
                         [("pallas-interpret", 2, "qwen3"), ("pallas-interpret", 2, "mistral_swa"),
                          ("pallas-interpret", 2, "gemma3"), ("pallas-interpret", 2, "qwen3_moe")] +
                         [("reference", 2, "phi4_mini")])   # LongRoPE's rope_long through the shard_map
def test_greedy_tokens_equal_tp1(ops, n, family):
    rows = run_worker("greedy", ops, str(n), family)
    assert [r["family"] for r in rows] == [family]
    assert rows[0]["tokens"] == golden_tokens(family)


def test_moe_one_sequence_at_a_time_on_split_layers_equals_tp1():
    """A mixture of experts' batch-1 decode (the routed GEMVs, whose combine adds no residual at TP > 1: it is added
    once, after the all-reduce) on the Pallas kernels in interpret mode, at TP 2 on split layers against TP 1;
    Qwen3-MoE's experts cut to 27 rows (padded to 28) and Mixtral (against its golden tokens too)."""
    rows = run_worker("one", "pallas-interpret", "qwen3_moe_27", "mixtral", devices=2)
    assert [(r["family"], r["n"]) for r in rows] == [("qwen3_moe_27", 1), ("qwen3_moe_27", 2), ("mixtral", 1),
                                                     ("mixtral", 2)]
    for one, two in (rows[:2], rows[2:]):
        assert all(len(t) == 16 for t in one["tokens"])
        assert two["tokens"] == one["tokens"], one["family"]
    golden = golden_tokens("mixtral")
    assert rows[3]["tokens"] == [golden[0], golden[3]]


def test_sampling_speculation_int8_cache_and_split_layers_equal_tp1():
    rows = run_worker("settings")
    assert [r["n"] for r in rows] == [1, 2]
    assert all(len(t) == 16 for t in rows[0]["tokens"])
    assert rows[1]["tokens"] == rows[0]["tokens"]


def test_prefix_cache_preemption_structured_output_penalties_and_logprobs_equal_tp1():
    """Greedy with prefix-cache hits and preemption on a float8 cache; JSON Schema, regex and choice outputs;
    sampled with penalties, logprobs and prompt logprobs over an odd vocabulary (1063) on an int8 cache."""
    one, two = run_worker("features", devices=2)
    assert one["n"] == 1 and two["n"] == 2
    assert one["preemptions"] > 0 and one["hit_rate"] > 0
    for key in ("tokens", "preemptions", "hit_rate", "structured", "sampled", "top"):
        assert two[key] == one[key], key
    assert json.loads(one["structured"][0]).keys() == {"name", "legs"}
    for key in ("logprobs", "prompt_logprobs"):
        for a, b in zip(two[key], one[key], strict=True):   # prompt by prompt (their lengths differ)
            np.testing.assert_allclose(np.array(a, float), np.array(b, float), atol=1e-4)


def test_commands_at_tp2_and_what_they_refuse():
    """`generate` and `bench` (Qwen3 and Qwen3-MoE) at --tensor-parallel-size 2, a completion served at TP 2 (generate's
    text at TP 1); 8-bit weights at TP 2: generate --quantization fp8 (its TP 1 text), bench on a pre-quantized W8A8
    checkpoint and with --quantization int8; what TP 2 cannot run is one line on stderr and exit code 2 (draft and
    DFlash models, a size the heads refuse, more devices than there are)."""
    rows = run_worker("commands", devices=2)
    ran, served, eight_bit, refused = rows[:4], rows[4], rows[5:9], rows[9:]
    assert [r["rc"] for r in ran + eight_bit] == [0] * 8, [r["stderr"][-500:] for r in ran + eight_bit]
    assert ran[1]["stdout"] == ran[0]["stdout"] and len(ran[0]["stdout"]) > len("once upon a time") + 8
    assert "throughput:" in ran[2]["stdout"] and "throughput:" in ran[3]["stdout"]
    assert served["served"] + "\n" == ran[0]["stdout"]
    assert eight_bit[1]["stdout"] == eight_bit[0]["stdout"]
    assert len(eight_bit[0]["stdout"]) > len("once upon a time") + 8
    assert "fp8 weights" in eight_bit[1]["stderr"] + eight_bit[1]["stdout"]
    assert "throughput:" in eight_bit[2]["stdout"] and "throughput:" in eight_bit[3]["stdout"]
    expected = ["n-gram speculation only", "n-gram speculation only", "does not fit the model's 8 attention heads",
                "needs 4096 devices"]
    assert len(refused) == len(expected)
    for r, message in zip(refused, expected):
        assert r["rc"] == 2 and message in r["stderr"], r
        assert r["stderr"].count("jaxinfer: error:") == 1 and "Traceback" not in r["stderr"], r


def test_8bit_logits_equal_tp1_and_lie_as_the_specs_say():
    """8-bit models at TP 2, 4 and 8 against the same 8-bit model at TP 1 (float32, reference ops): quantized at load
    (int8 and fp8; a tied lm_head; fused gate_up; GPT-2's transposed Conv1D; Gemma 3; both mixtures of experts, and
    experts cut to 27 rows that pad) and pre-quantized (the official FP8 block format, whose 128 x 128 blocks are
    larger than these matrices and straddle devices; compressed-tensors int8 and fp8 per channel; Qwen3-MoE's FP8
    experts). Every layer array, stacked or split, lies on the mesh as the shard_map's in_specs say."""
    from tensor_parallel_worker import QUANTIZED

    rows = run_worker("quantized")
    assert {(r["family"], r["fmt"], r["n"], r["per_layer"]) for r in rows} == {
        (f, q, n, p) for f, q in QUANTIZED for n in (2, 4, 8) for p in (False, True) if n == 2 or not p}
    for r in rows:
        assert r["quantized"] >= 4 and r["misplaced"] == [], r
        if not r["per_layer"]:
            assert r["shape"] == r["ref_shape"] and r["max_abs"] < 1e-4 and r["argmax_equal"], r


def test_8bit_greedy_tokens_on_the_kernels_equal_tp1():
    """Int8 Qwen3 (a batch of two) and Qwen3-MoE's official FP8 block format (one sequence at a time on split layers:
    the routed GEMVs' block scales) on the Pallas kernels in interpret mode: TP 2's greedy tokens are TP 1's."""
    rows = run_worker("quantized-greedy", devices=2)
    assert [(r["family"], r["n"]) for r in rows] == [("qwen3", 1), ("qwen3", 2), ("qwen3_moe-fp8-block", 1),
                                                     ("qwen3_moe-fp8-block", 2)]
    for one, two in (rows[:2], rows[2:]):
        assert all(len(t) == 16 for t in one["tokens"]) and two["tokens"] == one["tokens"], one["family"]


def run_two_processes(mode: str, devices: int = 1) -> list[list[dict]]:
    """The worker's `mode` in two processes on localhost (jax.distributed, `devices` CPU devices each, gloo)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
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


@pytest.mark.parametrize("devices", [1, 2])
def test_two_processes_give_the_tokens_of_one(devices):
    """Both processes run the same generate: TP 2 across the two (with two devices each, one of each process's)."""
    for rows in run_two_processes("distributed", devices):
        assert rows and rows[0]["n"] == 2 and rows[0]["tokens"] == golden_tokens("qwen3")
        assert rows[1]["least"] == 10   # the KV pool's size agreed on: the least of every process's


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

    with pytest.raises(TensorParallelError, match="n-gram speculation only"):
        LLM(MODELS / "llama3", tensor_parallel_size=2, skip_tokenizer_init=True, progress=False, speculative="draft:x")
    # the model's own misfits come before the device count (this process has one device)
    with pytest.raises(TensorParallelError, match="does not fit the model's 4 attention heads"):
        LLM(MODELS / "qwen3_moe", tensor_parallel_size=3, skip_tokenizer_init=True, progress=False)


def test_experts_are_split_by_their_intermediate_rows():
    """Every expert's gate|up rows (and down's columns) split as a dense MLP's, behind the layer and expert axes;
    the router replicated; a width that does not divide padded per device."""
    from jax.sharding import PartitionSpec as P

    from jaxinfer.model.tensor_parallel import param_specs

    cfg = load_config(MODELS / "qwen3_moe")   # 8 experts of 32 intermediate rows
    layers = param_specs(cfg)["layers"]
    assert layers["moe_gate_up"] == P(None, None, "tp") and layers["moe_down"] == P(None, None, None, "tp")
    assert layers["router"] == P(None)
    assert local_config(cfg, 8).moe_intermediate_size == 4
    rows = order("out", cfg, 8, [27, 27]).reshape(8, 2, 4)   # 27 rows: 4 a device, padded to 32 with zeros
    np.testing.assert_array_equal(rows[6], [[24, 25, 26, -1], [51, 52, 53, -1]])   # gate rows, then up rows
    assert (rows[7] == -1).all() and sorted(rows[rows >= 0]) == list(range(54))
    assert [r.shard for r in RULES["mixtral"] if r.dest.startswith("layers.moe_")] == ["out", "in"]


def test_fused_gate_up_is_split_by_halves():
    """Phi-3's gate_up_proj is one [2I, D] tensor: each device holds its own gate rows, then its own up rows."""
    cfg = load_config(MODELS / "phi3")   # intermediate 112: 28 a device of 4
    I = cfg.intermediate_size
    rows = order("gate_up", cfg, 4, [2 * I]).reshape(4, 2, -1)
    for d in range(4):
        np.testing.assert_array_equal(rows[d, 0], np.arange(d * 28, (d + 1) * 28))
        np.testing.assert_array_equal(rows[d, 1], I + np.arange(d * 28, (d + 1) * 28))
    assert [r.shard for r in RULES["phi3"] if r.dest == "layers.w_gate_up"] == ["gate_up"]


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


def test_throughput_and_prefill_run_at_tp2_on_the_cpu(tmp_path):
    """bench/throughput.py (the batched decode table) and bench/prefill.py --tensor-parallel-size 2 on 2 host devices
    give TP 1's greedy tokens (the decode table's hash, the prompt's first token), in bf16 and with int8 weights;
    prefill skips its hf path."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    runs = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        out.mkdir()
        hf = ["hf"] if tp > 1 else []   # (no transformers here: at TP 1 it would be a failed row)
        for args in (["throughput.py", "--shape", "tiny", "--ops", "reference", "--batches", "2", "--context", "40",
                      "--steps", "4", "--decode-only", "--lazy-compile", "--quantization", "int8"],
                     ["prefill.py", "--shapes", "tiny", "--prompts", "40", "--paths", "reference", *hf, "--chunk", "32",
                      "--quantization", "int8"]):
            r = subprocess.run([sys.executable, str(REPO / "bench" / args[0]), *args[1:], "--models",
                                str(tmp_path / "models"), "--out", str(out), "--tensor-parallel-size", str(tp)],
                               env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
            assert r.returncode == 0, r.stderr[-3000:]
            if tp == 2 and args[0] == "prefill.py":
                assert "skipping the transformers path(s) hf" in r.stdout
        runs[tp] = (json.loads((out / "throughput.json").read_text()), json.loads((out / "prefill.json").read_text()))
    for tp, (throughput, prefill) in runs.items():
        assert throughput["tensor_parallel_size"] == prefill["tensor_parallel_size"] == tp
        assert [r["path"] for r in prefill["rows"]] == ["reference", "reference+int8"]
        assert "error" not in json.dumps(prefill)
    assert [r["tokens_sha"] for r in runs[2][0]["decode"]] == [r["tokens_sha"] for r in runs[1][0]["decode"]]
    int8 = [[r["tokens_sha"] for r in runs[tp][0]["quantized"]["int8"]] for tp in (1, 2)]
    assert int8[0] == int8[1] and len(int8[0]) == 1
    assert [r["first_token"] for r in runs[2][1]["rows"]] == [r["first_token"] for r in runs[1][1]["rows"]]


class FakeChannel:
    """runner.distributed.CommandChannel in memory: numbered messages, None when message n has not come."""

    def __init__(self):
        self.messages: list[bytes] = []

    @property
    def sent(self) -> int:
        return len(self.messages)

    def send(self, message: bytes) -> None:
        self.messages.append(message)

    def receive(self, n: int, timeout_s: float = 60.0) -> bytes | None:
        return self.messages[n] if n < len(self.messages) else None


class FakeEngine:
    """Records its calls; `fail` names the calls (by their order among this engine's calls) that raise."""

    def __init__(self, fail: dict[int, Exception] | None = None):
        self.calls: list[tuple] = []
        self.fail = fail or {}

    def _call(self, *call):
        self.calls.append(call)
        if len(self.calls) - 1 in self.fail:
            raise self.fail[len(self.calls) - 1]
        return len(self.calls)

    def add_request(self, prompt, params=None):
        return self._call("add_request", tuple(prompt))

    def step(self):
        return self._call("step")

    def abort(self, request_id):
        return self._call("abort", request_id)

    def take_finished(self, request_id):
        return self._call("take_finished", request_id)


def lead(engine: FakeEngine, channel: FakeChannel) -> None:
    """Process 0's calls through a Leader: a request, a refused one, steps, an abort, a failing step (the server
    then aborts), an output taken; then stop."""
    from jaxinfer.engine.followers import Leader

    leader = Leader(engine, channel)
    leader.add_request([1, 2])
    for call in (lambda: leader.add_request([]), leader.step, lambda: leader.abort(0), leader.step,
                 lambda: leader.take_finished(0)):
        try:
            call()
        except (ValueError, RuntimeError):
            pass
    leader.stop_followers()


def test_a_follower_makes_the_leaders_calls_and_passes_over_what_failed_on_both():
    from jaxinfer.engine.followers import follow

    bad = {1: ValueError("prompt is empty"), 4: RuntimeError("a bug in a step")}
    leader, channel = FakeEngine(dict(bad)), FakeChannel()
    lead(leader, channel)
    follower = FakeEngine(dict(bad))
    assert follow(follower, channel) == 6
    assert follower.calls == leader.calls == [("add_request", (1, 2)), ("add_request", ()), ("step",),
                                              ("abort", 0), ("step",), ("take_finished", 0)]


@pytest.mark.parametrize("leader_fails,follower_fails", [({}, {4: RuntimeError("device")}),
                                                         ({4: RuntimeError("host")}, {}),
                                                         ({2: RuntimeError("x")}, {4: RuntimeError("y")})])
def test_a_call_that_failed_on_one_side_only_stops_the_follower(leader_fails, follower_fails):
    from jaxinfer.engine.followers import FollowerDiverged, follow

    channel = FakeChannel()
    lead(FakeEngine(leader_fails), channel)
    with pytest.raises(FollowerDiverged, match="no longer hold the same engine state"):
        follow(FakeEngine(follower_fails), channel)


def test_a_follower_whose_call_failed_does_not_wait_forever_for_the_leaders_note():
    """Process 0's step succeeded and now waits in a collective: no note comes, nor anything else."""
    import pickle

    from jaxinfer.engine.followers import FollowerDiverged, follow

    channel = FakeChannel()
    channel.send(pickle.dumps(("step", (), {})))
    with pytest.raises(FollowerDiverged, match="sent nothing within 0 s"):
        follow(FakeEngine({0: RuntimeError("out of memory")}), channel, note_timeout_s=0.0)


def test_the_leader_sends_calls_one_at_a_time_and_none_after_stop():
    """Two threads calling at once: each call's message is sent and the call made before the next's; after
    stop_followers a call raises (the followers would never join its collectives) and STOP is sent once."""
    import pickle
    import threading

    from jaxinfer.engine.followers import Leader

    engine, channel = FakeEngine(), FakeChannel()
    leader = Leader(engine, channel)
    threads = [threading.Thread(target=lambda k=k: [leader.add_request([k, i]) for i in range(300)]) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    leader.stop_followers()
    leader.stop_followers()
    sent = [pickle.loads(m) for m in channel.messages]
    assert [(name, tuple(args[0])) for name, args, _ in sent[:-1]] == engine.calls
    assert [name for name, _, _ in sent].count("stop") == 1 and sent[-1][0] == "stop"
    with pytest.raises(RuntimeError, match="stopped following"):
        leader.step()
    assert len(channel.messages) == len(sent)


def test_a_multi_host_mesh_takes_each_processes_share_of_devices():
    """2 hosts of 4 devices at TP 4: two of each host's (devices[:4] would leave host 1 none of the shards and
    nothing to run); a size the processes cannot share evenly, or more than a host has, is one clear error."""
    from types import SimpleNamespace

    from jaxinfer.runner.mesh import mesh_devices

    devices = [SimpleNamespace(id=i, process_index=i // 4, platform="gpu") for i in range(8)]
    assert [d.id for d in mesh_devices(devices, 4, 2)] == [0, 1, 4, 5]
    assert [d.id for d in mesh_devices(devices, 8, 2)] == list(range(8))
    assert [d.id for d in mesh_devices(devices[:4], 2)] == [0, 1]
    with pytest.raises(TensorParallelError, match="each process must hold the same number"):
        mesh_devices(devices, 1, 2)   # --distributed at TP 1: the other host would hold nothing
    with pytest.raises(TensorParallelError, match="needs 8 devices in each of 2 processes; there are 4"):
        mesh_devices(devices, 16, 2)


def test_distributed_flag_errors_are_one_line_and_exit_code_2(capsys):
    """chat reads one terminal and refuses --distributed; a malformed spec is refused before JAX starts."""
    from jaxinfer.cli import main

    for args, message in ((["chat", "--model", str(MODELS / "llama3"), "--distributed", "localhost:1,2,0"],
                           "chat runs on one host"),
                          (["generate", "--model", str(MODELS / "llama3"), "--distributed", "localhost:1,2", "x"],
                           "distributed must be HOST:PORT,NUM_PROCESSES,PROCESS_ID"),
                          (["bench", "--model", str(MODELS / "llama3"), "--distributed", "localhost:1,2,2"],
                           "0 <= PROCESS_ID < NUM_PROCESSES")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_block_scales_take_a_grid_no_device_straddles():
    """Block scales over a split axis: the largest grid dividing the block on which every run of positions is one
    device's and inside one block (Qwen3-30B-A3B-FP8's 768 expert rows in 128-row blocks: 192 a device at TP 4 ->
    64-row runs, 96 at TP 8 -> 32); padding runs take no block."""
    from jaxinfer.model.tensor_parallel import _block_grid

    cfg = load_config(MODELS / "qwen3_moe")
    for n, want in ((2, 128), (4, 64), (8, 32)):
        idx = order("out", cfg, n, [768, 768])   # gate rows then up rows, device by device
        grid, at = _block_grid(idx, 128, len(idx) // n)
        assert grid == want
        np.testing.assert_array_equal(at, idx[::grid] // 128)
    idx = order("out", cfg, 2, [27])   # 14 a device, the last padded: runs of one position
    grid, at = _block_grid(idx, 16, 14)
    assert grid == 1 and at[-1] == -1 and list(at[:14]) == [0] * 14
