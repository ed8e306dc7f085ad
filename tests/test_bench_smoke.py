"""The GPU benchmarks run end to end on the CPU at a tiny shape (XLA path; kernel benches in interpret mode), so that a GPU session's
minutes are never lost to a script error. Their figures here mean nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import without_jax_cache

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path, script, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path)}
    if script == "warm_start.py":   # its first run cold: JAX's cache only in the runs' own HOME (tests/conftest.py)
        env = without_jax_cache(env)
    where = [] if script.startswith("kernels/") else ["--models", str(tmp_path / "models"), "--out", str(tmp_path)]
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), *where, *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("script,args,out", [
    ("decode.py", ["--shapes", "tiny", "--long", "--paths", "reference", "reference-scan", "reference-fp8", "--prompt", "40",
                   "--new", "9", "--steps", "4"], "decode.json"),
    ("decode.py", ["--shapes", "tiny-moe@1", "--long", "--paths", "reference", "--prompt", "24", "--new", "6", "--steps",
                   "3"], "decode.json"),
    ("prefill.py", ["--shapes", "tiny", "--prompts", "40", "--paths", "reference", "--chunk", "32", "--sequences", "2"],
     "prefill.json"),
    ("throughput.py", ["--shape", "tiny", "--ops", "reference", "--batches", "1", "3", "--context", "40", "--steps", "6",
                       "--requests", "5", "--system", "64", "--kv-cache-dtype", "fp8"], "throughput.json"),
    ("throughput.py", ["--shape", "tiny", "--ops", "reference", "--batches", "2", "--context", "40", "--steps", "4",
                       "--decode-only", "--attention-config", "2/16"], "throughput.json"),
    ("speculative.py", ["--shape", "tiny", "--prompt", "32", "--new", "12", "--contexts", "32", "--widths", "4",
                        "--ks", "3", "--batch", "3", "--batch-prompt", "16", "--sections", "verify", "oracle",
                        "batched"], "speculative.json"),
    ("kernels/verify_attention.py", ["--interpret", "--sweep", "--no-table", "--points", "4:2:40", "--budget", "60"],
     "verify_attention.json"),
    ("warm_start.py", ["--shape", "tiny"], "warm_start.json"),
    ("warm_start.py", ["--serve", "--shape", "tiny", "--max-model-len", "64", "--max-num-seqs", "2", "--runs", "1"],
     "warm_start_serve.json"),
    ("kernels/fused_gemv.py", ["--interpret", "--shape", "tiny", "--layers", "2", "--repeats", "1", "--rows", "1", "2"],
     "fused_gemv.json"),
    ("kernels/hopper_gemm.py", ["--interpret", "--shape", "tiny", "--rows", "128", "--layers", "2", "--configs", "best"],
     "kernels_hopper_gemm.json"),
    ("kernels/hopper_gemm.py", ["--interpret", "--shape", "tiny", "--rows", "128", "--layers", "2", "--w8a8", "fp8",
                                "--only", "qkv", "down"], "kernels_hopper_gemm_w8a8.json"),
    ("kernels/hopper_attention.py", ["--interpret", "--tokens", "128", "--configs", "2"], "kernels_hopper_attention.json"),
    ("kernels/top_k.py", ["--vocab", "5000", "--rows", "1", "3", "--calls", "2"], "top_k.json"),
    ("kernels/moe.py", ["--interpret", "--tokens", "1", "8"], "moe.json"),
    ("kernels/moe.py", ["--interpret", "--tokens", "1", "8", "--format", "fp8"], "moe.json"),
    ("kernels/sampling.py", ["--vocab", "20000", "--rows", "1", "3", "--calls", "2"], "sampling.json"),
    ("kernels/skinny_gemm.py", ["--interpret", "--sweep", "--budget", "30"], "skinny_gemm.json"),
    ("kernels/quantized_gemv.py", ["--interpret", "--shapes", "tiny", "--formats", "fp8", "--no-gemv", "--batched", "5"],
     "quantized_gemv.json"),
    ("kernels/skinny_gemm.py", ["--interpret", "--norm"], "skinny_norm_gemm.json"),
    ("kernels/decode_attention_rope.py", ["--interpret", "--points", "2:40"], "decode_attention_rope.json"),
    ("kernels/decode_attention.py", ["--interpret", "--sweep", "--no-table", "--kv-cache-dtype", "fp8", "--query-dtype",
                                     "float16", "--points", "2:40", "--budget", "200"], "decode_attention.json"),
])
def test_bench_runs(tmp_path, script, args, out):
    stdout = _run(tmp_path, script, *args)
    data = json.loads((tmp_path / out).read_text())
    assert data
    assert "failed" not in stdout and "error" not in json.dumps(data), stdout[-2000:]
    if script == "warm_start.py":   # each run to its first token, cold then warm, with the engine's summary line
        rows = data["rows"]
        assert [r["cache"] for r in rows] == ["cold", "warm"][:len(rows)] and all(r["first_token_s"] > 0 for r in rows)
        assert all(r["summary"].startswith("[jaxinfer: tiny") for r in rows), rows
    if script == "kernels/quantized_gemv.py":   # each product of the batched rows ran and matched its reference
        kernels = {r["kernel"] for r in data["batched"] if "FAIL" not in r["err"]}
        assert kernels == {"xla", "xla-w8a8", "skinny", "skinny-w8a8"} and "winners_8bit" in data, data["batched"]
    if script == "prefill.py":   # the machine, versions, date and command with the figures
        assert {"device", "jax", "date", "argv", "gemm"} <= set(data)
        assert data["argv"][:2] == ["--models", str(tmp_path / "models")]
        assert all(r["start_s"] > 0 for r in data["rows"]), data["rows"]


@pytest.mark.parametrize("client", ["httpx", "aiohttp"])
def test_serving_bench_with_the_host_profile(tmp_path, client):
    """bench/serving.py starts a server on stories260k, loads it, and reports the engine thread's
    shares and where its busy samples went (JAXINFER_HOST_PROFILE), and traces the server's device."""
    from conftest import STORIES

    out = tmp_path / "serving.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAXINFER_HOST_PROFILE": str(tmp_path / "host.json")}
    r = subprocess.run([sys.executable, str(REPO / "bench" / "serving.py"), "--serve-model", str(STORIES),
                        "--request-rates", "inf", "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                        "--serve-args=--max-num-seqs 16",   # the server's batch before its default became 256
                        "--out", str(out), "--device-trace", str(tmp_path / "traces"), "--device-trace-seconds", "0.3",
                        "--client", client],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(out.read_text())["results"][0]
    assert row["completed"] == 4 and row["failed"] == 0
    assert row["host_profile"]["jaxinfer-engine"]["samples"] > 0
    assert row["server_ttft_mean_ms"] > 0
    assert row["prefill_steps_mean"] >= 1 and sum(v["count"] for v in row["mixed_steps"].values()) >= 1
    assert "steps to first token" in r.stdout
    assert row["event_loop_lag"]["samples"] > 0 and row["event_loop_lag"]["mean_ms"] >= 0
    # the device trace window ran; on the CPU the trace has no device kernels to summarize
    assert list((tmp_path / "traces" / "rate-inf").rglob("perfetto_trace.json.gz"))
    assert row["device_trace"] == {"error": "no device kernel events in the trace"}, row["device_trace"]
    assert "device trace, rate inf" in r.stdout
    assert "host profile, rate inf, thread jaxinfer-engine" in r.stdout


def test_throughput_forces_the_attention_config(monkeypatch):
    """--attention-config reaches both decode attention kernels' config choice (the A/B of a table row)."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.throughput import force_attention_config
    from jaxinfer.pallas import decode_attention, decode_attention_rope

    for module in (decode_attention, decode_attention_rope):
        monkeypatch.setattr(module, "choose_config", module.choose_config)
    assert decode_attention.choose_config(8, 8, 40960) != decode_attention.SplitConfig(2, 16)
    force_attention_config(2, 16)
    for module in (decode_attention, decode_attention_rope):
        assert module.choose_config(8, 8, 40960) == decode_attention.SplitConfig(2, 16)


def test_the_attention_sweeps_second_pass_and_its_winner_as_a_table_row(monkeypatch, tmp_path):
    """bench/kernels/decode_attention_rope.py's second pass tries the best's warps and stages and the next two's
    deeper pipelines; experiments/attention_table_from_sweep.py makes the fastest right config the int8 table's
    batch-1 long-context row (for experiments/with_tables.py), and nothing where no config was right."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.kernels.decode_attention_rope import variants
    from jaxinfer.pallas import tables
    from jaxinfer.pallas.decode_attention import SplitConfig, choose_config

    top = [SplitConfig(32, 128), SplitConfig(64, 64), SplitConfig(16, 128)]
    got = variants(top)
    assert len(got) == len(set(got)) == 11
    assert {(c.num_warps, c.num_stages) for c in got if c.num_splits == 32} == {(2, 2), (8, 2), (4, 1), (4, 3), (4, 4),
                                                                                (8, 3), (4, 2)}
    assert {c for c in got if c.num_splits != 32} == {SplitConfig(64, 64, num_stages=3), SplitConfig(64, 64, num_stages=4),
                                                      SplitConfig(16, 128, num_stages=3),
                                                      SplitConfig(16, 128, num_stages=4)}
    rows = [{"cfg": {"num_splits": 32, "block_k": 128, "num_stages": 3}, "us": 30.0, "ok": True},
            {"cfg": {"num_splits": 64, "block_k": 64, "num_stages": 4}, "us": 25.0, "ok": True},
            {"cfg": {"num_splits": 128, "block_k": 32, "num_stages": 4}, "us": 20.0, "ok": False}]
    (tmp_path / "s.json").write_text(json.dumps({"points": [{"B": 1, "ctx": 32768, "rows": rows}]}))
    script = [sys.executable, str(REPO / "experiments" / "attention_table_from_sweep.py"), str(tmp_path / "s.json")]
    assignment = subprocess.run(script, capture_output=True, text=True, check=True).stdout
    monkeypatch.setattr(tables, "DECODE_ATTENTION_INT8", list(tables.DECODE_ATTENTION_INT8))
    exec(assignment, vars(tables))
    assert choose_config(1, 8, 32768, 1, True) == SplitConfig(64, 64, num_stages=4)
    assert choose_config(1, 8, 1024, 1, True) == choose_config(1, 8, 1024, 1)   # other rows as they were
    (tmp_path / "s.json").write_text(json.dumps({"points": [{"B": 1, "ctx": 32768, "rows": rows[2:]}]}))
    assert subprocess.run(script, capture_output=True).returncode == 1


def test_the_gemv_sweeps_winners_as_table_rows(monkeypatch, tmp_path):
    """experiments/gemv_table_from_sweep.py: each projection's fastest swept int8 config of the shape asked for
    becomes the 8-bit GEMV tables' rows, keyed as fused_gemv looks them up (gate/up by its gate rows); the table's own
    row, other shapes and other formats are not candidates; no swept row at all is an error."""
    import jax.numpy as jnp

    from jaxinfer.pallas import fused_gemv, tables

    def row(projection, dims, config, us, shape="llama3-8b", fmt="int8"):
        return dict(shape=shape, projection=projection, dims=dims, format=fmt, config=config, us=us)
    rows = [row("gate/up", "28672x4096", "table", 10.0, fmt="bf16"),
            row("gate/up", "28672x4096", "block_in 512, rows 1, cvt", 30.0),
            row("gate/up", "28672x4096", "block_in 256, rows 2, prmt, 2 warps", 29.0),
            row("gate/up", "28672x4096", "block_in 1024, rows 4, prmt", 5.0, shape="qwen3-4b"),
            row("gate/up", "28672x4096", "block_in 1024, rows 4", 5.0, fmt="fp8"),
            row("o_proj", "4096x4096", "block_in 1024, rows 1, prmt", 8.0),
            row("o_proj", "4096x4096", "block_in 256, rows 2, cvt", 9.0)]
    (tmp_path / "s.json").write_text(json.dumps({"gemv": rows}))
    script = [sys.executable, str(REPO / "experiments" / "gemv_table_from_sweep.py"), str(tmp_path / "s.json"),
              "--shape", "llama3-8b"]
    lines = subprocess.run(script, capture_output=True, text=True, check=True).stdout.splitlines()
    for name in ("GEMV_BLOCK_IN_8BIT", "GEMV_ROWS_8BIT", "GEMV_WARPS_8BIT", "GEMV_INT8_CONVERT_BY_SHAPE"):
        monkeypatch.setattr(tables, name, dict(getattr(tables, name)))
    for line in lines:
        exec(line, vars(tables))
    i8 = jnp.int8
    assert (fused_gemv.block_in_for(14336, 4096, i8), fused_gemv.rows_for(14336, 4096, i8),
            fused_gemv.warps_for(14336, 4096, i8), fused_gemv.int8_convert_for(14336, 4096)) == (256, 2, 2, "prmt")
    assert (fused_gemv.block_in_for(4096, 4096, i8), fused_gemv.rows_for(4096, 4096, i8),
            fused_gemv.warps_for(4096, 4096, i8), fused_gemv.int8_convert_for(4096, 4096)) == (1024, 1, 1, "prmt")
    assert len(lines) == 8
    assert subprocess.run(script[:-1] + ["gpt2"], capture_output=True).returncode == 1


def test_the_tiled_rope_write_option_reaches_the_kernel(monkeypatch):
    """The rope-tiled variants: the bench option sets tables.ROPE_KV_WRITE_TILE."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.variant_runs import apply_bench_options
    from jaxinfer.pallas import tables

    monkeypatch.setattr(tables, "ROPE_KV_WRITE_TILE", 8)
    # a patched table keeps the executable cache (its key sees the tables); a patched function turns it off
    assert apply_bench_options({"rope_write_tiled": 16, "unroll_layers": True}) == {"unroll_layers": True}
    import jaxinfer.engine.engine

    monkeypatch.setattr(jaxinfer.engine.engine, "to_device_packed", jaxinfer.engine.engine.to_device_packed)   # restored after
    assert apply_bench_options({"unpacked_batch": True}) == {"executable_cache": False}
    assert tables.ROPE_KV_WRITE_TILE == 16
    apply_bench_options({"rope_write_tiled": 32})
    assert tables.ROPE_KV_WRITE_TILE == 32


def test_the_flash_table_option_sets_the_fresh_prompt_kernels_lengths(monkeypatch):
    """The cudnn-attention / hopper-flash variants: the bench option replaces tables.FRESH_PROMPT_FLASH."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.variant_runs import apply_bench_options
    from jaxinfer.pallas import tables
    from jaxinfer.pallas.tables import FlashConfig

    monkeypatch.setattr(tables, "FRESH_PROMPT_FLASH", [(1024, 2048, FlashConfig())])
    assert apply_bench_options({"flash_table": [[1024, 2048, {"stages": 1, "q_buffers": 2}]]}) == {}
    assert tables.FRESH_PROMPT_FLASH == [(1024, 2048, FlashConfig(stages=1, q_buffers=2))]
    apply_bench_options({"flash_table": []})
    assert tables.FRESH_PROMPT_FLASH == []


def test_the_gemv_block_in_option_reaches_the_engines_gemvs(monkeypatch):
    """The oproj-in* variants: the bench option sets block_in for those shapes only (the engine's GEMVs read it
    through fused_gemv.block_in_for)."""
    monkeypatch.syspath_prepend(str(REPO))
    import jax.numpy as jnp

    from bench.variant_runs import apply_bench_options
    from jaxinfer.pallas import tables
    from jaxinfer.pallas.fused_gemv import block_in_for

    monkeypatch.setattr(tables, "GEMV_BLOCK_IN", dict(tables.GEMV_BLOCK_IN))
    assert apply_bench_options({"gemv_block_in": {(2560, 4096): 512, (7, 64): 32}}) == {}
    assert block_in_for(2560, 4096, jnp.bfloat16) == 512 and block_in_for(7, 64, jnp.bfloat16) == 32
    assert block_in_for(6144, 2560, jnp.bfloat16) == tables.GEMV_BLOCK_IN[(6144, 2560)] == 128   # others as they were


def test_the_skinny_sweeps_winners_reach_the_table(monkeypatch, tmp_path):
    """bench/kernels/skinny_gemm.py keeps a swept config only where it beat XLA at that M in the same run;
    throughput.py --skinny-table adds those rows to skinny_gemm's table (the executable cache stays on: its key
    sees the table)."""
    monkeypatch.syspath_prepend(str(REPO))
    import json

    import bench.throughput as T
    from bench.kernels.skinny_gemm import sweep_winners
    from jaxinfer.pallas import skinny_gemm as SG
    from jaxinfer.pallas import tables

    cfg = dict(block_n=32, block_k=256, num_warps=4, num_stages=3, split_k=1)
    results = {"sweep": [dict(shape=[19456, 2560], epilogue="swiglu", M=32, top=[dict(cfg=cfg, us=27.0)]),
                         dict(shape=[6144, 2560], epilogue="none", M=32, top=[dict(cfg=cfg, us=11.9)])],
               "rows": [dict(shape=[19456, 2560], epilogue="swiglu", M=32, xla_ok=True, xla_us=32.7),
                        dict(shape=[6144, 2560], epilogue="none", M=32, xla_ok=True, xla_us=12.0)]}
    winners = sweep_winners(results)
    assert [(w["shape"], w["M"]) for w in winners] == [([19456, 2560], 32)]   # 11.9 against 12.0 is no win
    (tmp_path / "s.json").write_text(json.dumps({**results, "winners": winners}))
    monkeypatch.setattr(tables, "SKINNY_GEMM", dict(tables.SKINNY_GEMM))
    monkeypatch.setattr(T, "_FORCED", [])
    assert SG.table_config(32, 19456, 2560, "swiglu") is None
    T.patch_skinny_table(str(tmp_path / "s.json"))
    assert SG.table_config(32, 19456, 2560, "swiglu") == SG.SkinnyConfig(**cfg)
    assert not T._FORCED   # a table the executable cache's key sees: the cache stays on


def test_the_8bit_sweeps_winners_reach_the_8bit_table(monkeypatch, tmp_path):
    """bench/kernels/quantized_gemv.py --batched keeps a skinny config (converted tiles or W8A8) only where it beat
    XLA's best product by 3%; throughput.py --skinny-table adds the run's format's rows to SKINNY_GEMM_8BIT, and
    refuses rows of two formats (the table has no format in its key)."""
    monkeypatch.syspath_prepend(str(REPO))
    import json

    import bench.throughput as T
    from bench.kernels.quantized_gemv import batched_winners, table_rows
    from jaxinfer.pallas import skinny_gemm as SG
    from jaxinfer.pallas import tables

    w8a8 = (64, 128, 4, 4, 1, True)
    row = lambda fmt, kernel, us, cfg="": dict(dims="6144x2560", epilogue="none", format=fmt, M=64, kernel=kernel,   # noqa: E731
                                               us=us, config=cfg, err="1e-3")
    rows = [row("fp8", "xla", 14.6), row("fp8", "xla-w8a8", 13.4), row("fp8", "skinny-w8a8", 7.0, w8a8),
            row("int8", "xla", 14.0), row("int8", "skinny-w8a8", 13.9, w8a8)]       # 13.9 against 14.0: no win
    winners = table_rows(batched_winners(rows))
    assert [(w["format"], w["cfg"]["w8a8"]) for w in winners] == [("fp8", True)]
    (tmp_path / "q.json").write_text(json.dumps({"winners_8bit": winners + [dict(winners[0], format="int8")]}))
    monkeypatch.setattr(tables, "SKINNY_GEMM_8BIT", {})
    T.patch_skinny_table(str(tmp_path / "q.json"), ["fp8"])
    assert SG.table_config(64, 6144, 2560, "none", eight_bit=True) == SG.SkinnyConfig(*w8a8)
    assert SG.table_config(64, 6144, 2560, "none") != SG.SkinnyConfig(*w8a8)     # the bf16 table is untouched
    with pytest.raises(SystemExit, match="one --quantization format"):
        T.patch_skinny_table(str(tmp_path / "q.json"), ["fp8", "int8"])


@pytest.mark.parametrize("workload", ["engine", "no-cudnn", "synthetic", "qkv", "gate-up", "o-proj", "down",
                                      "attention", "attention-rope", "skinny", "skinny-gate-up", "skinny-down",
                                      "routed-gate-up", "routed-combine"])
def test_ncu_kernels_child_runs_its_workload(tmp_path, workload):
    """bench/ncu_kernels.py: the workloads ncu watches run (B sequences, a prompt each, greedy tokens; or decode
    dispatches on an unwritten cache, whose rows advance from the context's position)."""
    # the fused kernel takes head dims >= 32; the routed GEMVs a mixture of experts (and one token)
    shape = {"attention-rope": "qwen3-0.6b", "routed-gate-up": "tiny-moe", "routed-combine": "tiny-moe"}.get(workload,
                                                                                                           "tiny")
    batch = "1" if workload.startswith("routed") else "2"
    out = _run(tmp_path, "ncu_kernels.py", "--child", "--batch", batch, "--shape", shape, "--ops", "reference",
               "--context", "40", "--tokens", "3", "--workload", workload)
    if workload == "o-proj":   # a GEMV at another block_in and rows than the engine's
        _run(tmp_path, "ncu_kernels.py", "--child", "--batch", "1", "--shape", shape, "--context", "40", "--tokens", "2",
             "--workload", workload, "--block-in", "32", "--rows", "2")
    if workload in ("attention-rope", "down"):   # an int8 cache / int8 weights, as ncu would watch them
        eight_bit = ["--int8-convert", "prmt"] if workload == "attention-rope" else ["--weights", "int8"]
        out = _run(tmp_path, "ncu_kernels.py", "--child", "--batch", "1", "--shape", shape, "--context", "40",
                   "--tokens", "2", "--workload", workload, *eight_bit)
        assert "'int8'" in out.split("operand dtypes")[1].splitlines()[0], out
    if workload == "synthetic":
        positions = json.loads(out.split("rows now at positions ")[1].splitlines()[0])
        assert len(positions) == 2 and all(p > 40 for p in positions) and positions[0] == positions[1], out


def test_ncu_kernels_without_ncu_says_so(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    import bench.ncu_kernels as N

    monkeypatch.setattr(N.shutil, "which", lambda name: None)
    monkeypatch.setattr(N.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(sys, "argv", ["ncu_kernels.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="ncu .* not on this machine"):
        N.main()


def test_ncu_kernels_reads_the_details_page():
    """ncu's `--csv --page details` (its ==PROF== lines mixed in): one row a launch, durations in microseconds, the
    blocks-per-SM limiter named."""
    sys.path.insert(0, str(REPO))
    from bench.ncu_kernels import limiter, parse_details, table

    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
            '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

    def row(i, kernel, section, metric, unit, value):
        return (f'"{i}","7","python3","127.0.0.1","{kernel}","1","7","(128, 1, 1)","(1, 8, 32)","0","9.0",'
                f'"{section}","{metric}","{unit}","{value}"')

    text = "\n".join([
        "==PROF== Connected to process 7", head,
        row(0, "gemv_none_norm", "GPU Speed Of Light Throughput", "Duration", "usecond", "9.71"),
        row(0, "gemv_none_norm", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "71.20"),
        row(0, "gemv_none_norm", "GPU Speed Of Light Throughput", "L2 Cache Throughput", "%", "55.10"),
        row(0, "gemv_none_norm", "Launch Statistics", "Registers Per Thread", "register/thread", "40"),
        row(0, "gemv_none_norm", "Occupancy", "Block Limit Registers", "block", "12"),
        row(0, "gemv_none_norm", "Occupancy", "Block Limit Warps", "block", "16"),
        row(1, "decode_attention_rope_split", "GPU Speed Of Light Throughput", "Duration", "ns", "4,310.50"),
        row(1, "decode_attention_rope_split", "Occupancy", "Block Limit Registers", "block", "3"),
        row(1, "decode_attention_rope_split", "Occupancy", "Block Limit Shared Mem", "block", "3"),
        "==PROF== Report: /tmp/ncu-B1.ncu-rep"])
    kernels = parse_details(text)
    assert [k["kernel"] for k in kernels] == ["gemv_none_norm", "decode_attention_rope_split"]
    assert kernels[0]["Duration"] == 9.71 and kernels[1]["Duration"] == pytest.approx(4.3105)
    assert kernels[0]["Registers Per Thread"] == 40.0
    assert limiter(kernels[0]) == "Registers (12)" and limiter(kernels[1]) == "Registers/Shared Mem (3)"
    out = table(kernels)
    assert "| gemv_none_norm | 9.71 | 71.2 | 55.1 | - |" in out and "4.31" in out


def test_kernel_registers_occupancy_matches_what_ncu_reported():
    """bench/kernel_registers.py's blocks an SM by registers, against the limits Nsight Compute reported on the
    H200: 66 registers -> 28 one-warp blocks, 98 -> 16, 92 with 4 warps -> 5, 48 with 4 -> 10."""
    from bench.kernel_registers import occupancy

    assert [occupancy(r, w, 132)[0] for r, w in [(66, 1), (98, 1), (92, 4), (48, 4), (32, 1)]] == [28, 16, 5, 10, 32]
    assert occupancy(98, 1, 2560)[1] == pytest.approx(2560 / (132 * 16))


def test_kernel_registers_finds_each_kernels_triton_module():
    """The lowering half of bench/kernel_registers.py (no GPU, no triton package): each Pallas kernel of a workload
    with its launch attributes and its Triton module."""
    from bench.kernel_registers import triton_modules
    from bench.ncu_kernels import kernel_call

    found = triton_modules(*kernel_call("o-proj", "qwen3-4b", 1, 1024, block_in=128))
    assert [(a["name"], a["grid_x"], a["num_warps"]) for a, _ in found] == [("gemv_residual", 2560, 1)]
    assert "tt.func public @gemv_residual" in found[0][1]
    names = [a["name"] for a, _ in triton_modules(*kernel_call("attention-rope", "qwen3-4b", 8, 1024))]
    assert names == ["decode_attention_rope_split", "decode_attention_merge"]


def test_kernel_registers_new_workloads_lower_and_sass_loops_read_a_loop():
    """The grouped GEMM workloads (B rows over Mixtral's experts) and the attention workloads on an int8 cache lower
    to their Triton modules; sass_loops finds a backward branch's body in cuobjdump's format and counts its opcodes
    without predicates or modifiers."""
    from bench.kernel_registers import sass_loops, triton_modules
    from bench.ncu_kernels import kernel_call

    names = [a["name"] for a, _ in triton_modules(*kernel_call("grouped-down", "mixtral-8x7b", 256, 0))]
    assert names == ["grouped_gemm_none"]
    found = triton_modules(*kernel_call("attention-rope", "qwen3-4b", 1, 32767, int8_convert="prmt"))
    assert found[0][0]["name"] == "decode_attention_rope_split" and "xi8" in found[0][1]
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/               @P0 LDS.U8 R2, [R3] ;
        /*0030*/                   LDS.U8 R5, [R3+0x1] ;
        /*0040*/               @P1 BRA 0x10 ;
        /*0050*/                   EXIT ;
    """
    assert sass_loops(sass) == [dict(length=4, ops={"LDS": 2, "HMMA": 1, "BRA": 1})]


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_kernel_registers_8bit_workloads_are_the_engines_kernels(weights):
    """--weights int8|fp8: the GEMV workloads lower to the 8-bit kernels with the rows and int8 conversion the engine's
    ops give them (int8 down: one row, "prmt" by tables.GEMV_INT8_CONVERT_BY_SHAPE; o_proj: one row too); the skinny and
    grouped workloads to their 8-bit kernels."""
    from bench.kernel_registers import triton_modules
    from bench.ncu_kernels import kernel_call

    (attrs, module), = triton_modules(*kernel_call("down", "qwen3-4b", 1, 1024, weights=weights))
    assert (attrs["name"], attrs["grid_x"]) == ("gemv_residual_8bit", 2560)
    assert ("i8" if weights == "int8" else "f8E4M3FN") in module
    if weights == "int8":
        assert "prmt" in module   # tables.GEMV_INT8_CONVERT_BY_SHAPE[(2560, 9728)]
    (attrs, _), = triton_modules(*kernel_call("o-proj", "qwen3-4b", 1, 1024, weights=weights))
    assert attrs["grid_x"] == 2560   # one row a program (GEMV_ROWS_8BIT has no o_proj row since 2026-12-05)
    (attrs, _), = triton_modules(*kernel_call("skinny-gate-up", "qwen3-4b", 64, 1024, weights=weights))
    assert attrs["name"] == "skinny_gemm_swiglu_8bit"
    (attrs, module), = triton_modules(*kernel_call("grouped-down", "mixtral-8x7b", 256, 0, weights=weights))
    assert attrs["name"] == "grouped_gemm_none" and ("xi8" if weights == "int8" else "xf8E4M3FN") in module
    for name, kernel in (("routed-gate-up", "routed_gemv_swiglu"), ("routed-combine", "routed_gemv_combine")):
        (attrs, module), = triton_modules(*kernel_call(name, "qwen3-30b-a3b", 1, 0, weights=weights))
        assert attrs["name"] == kernel and ("i8" if weights == "int8" else "f8E4M3FN") in module


def test_the_hopper_table_option_takes_each_rows_fastest_config(monkeypatch, tmp_path):
    """prefill_dispatch's hopper-fastest variant: each of hopper_gemm's table rows (a measured row count) takes the
    config that ran fastest and right in bench/kernels/hopper_gemm.py's JSON; rows it did not time keep theirs."""
    monkeypatch.syspath_prepend(str(REPO))
    import json

    from bench.variant_runs import apply_bench_options
    from jaxinfer.pallas import hopper_gemm, tables
    from jaxinfer.pallas.hopper_gemm import HopperConfig

    monkeypatch.setattr(tables, "HOPPER_GEMM", dict(tables.HOPPER_GEMM))
    fastest = HopperConfig(64, 128, 64, 5)
    results = [dict(N=6144, K=2560, epilogue="none", M=1024, config=fastest.__dict__, us=40.0, rel_err=0.0),
               dict(N=6144, K=2560, epilogue="none", M=1024, config=HopperConfig().__dict__, us=30.0, rel_err=1.0),
               dict(N=6144, K=2560, epilogue="none", M=1024, config=HopperConfig(stages=3).__dict__, us=45.0,
                    rel_err=0.0)]
    path = tmp_path / "kernels_hopper_gemm.json"
    path.write_text(json.dumps(dict(results=results)))
    gate_up_before = tables.HOPPER_GEMM[(19456, 2560, "swiglu")]
    assert apply_bench_options({"hopper_table": str(path)}) == {}
    assert hopper_gemm.table_config(1024, 6144, 2560, "none") == fastest       # the wrong 30 us one is passed over
    assert tables.HOPPER_GEMM[(19456, 2560, "swiglu")] == gate_up_before


def test_the_hopper_8bit_table_option_takes_the_w8a8_winners(monkeypatch, tmp_path):
    """bench/prefill.py --hopper-8bit-table: each product and row count of a --w8a8 run's "winners_8bit" goes into
    tables.HOPPER_GEMM_8BIT (replacing an earlier row of the same count), and the ops' lookup finds it."""
    monkeypatch.syspath_prepend(str(REPO))
    import json

    from bench.kernels.hopper_gemm import patch_table_8bit
    from jaxinfer.pallas import hopper_gemm, tables
    from jaxinfer.pallas.hopper_gemm import HopperConfig

    monkeypatch.setattr(tables, "HOPPER_GEMM_8BIT", {(6144, 2560, "none", "fp8"): ((1024, 1024, HopperConfig()),
                                                                                    (2048, 2048, HopperConfig()))})
    won = HopperConfig(64, 192, 128, 4)
    winners = [dict(N=6144, K=2560, epilogue="none", M=1024, config=won.__dict__, us=30.0, xla_us=40.0),
               dict(N=2560, K=9728, epilogue="residual", M=8192, config=HopperConfig(64, 256, 128, 2).__dict__,
                    us=300.0, xla_us=400.0)]
    path = tmp_path / "kernels_hopper_gemm_w8a8.json"
    path.write_text(json.dumps(dict(w8a8="fp8", results=winners, winners_8bit=winners)))
    patch_table_8bit(str(path))
    assert hopper_gemm.table_config(1024, 6144, 2560, "none", eight_bit="fp8") == won
    assert hopper_gemm.table_config(2048, 6144, 2560, "none", eight_bit="fp8") == HopperConfig()
    assert hopper_gemm.table_config(8192, 2560, 9728, "residual", eight_bit="fp8") == HopperConfig(64, 256, 128, 2)
    assert hopper_gemm.table_config(1024, 6144, 2560, "none", eight_bit="int8") is None   # an fp8 run's rows
    assert hopper_gemm.table_config(8192, 2560, 9728, "residual") is None       # the bf16 table is untouched
