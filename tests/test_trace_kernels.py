"""bench/trace_kernels.summarize on a hand-made trace: kernel time, busy time (overlaps merged), idle gaps."""

import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.trace_kernels import request_timeline, summarize


def _trace(tmp_path, kernels, args=None):
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 2, "name": "host work", "ts": 0, "dur": 10_000}]
    events += [{"ph": "X", "pid": 1, "name": n, "ts": ts, "dur": dur, "args": (args or {}).get(n, {})}
               for n, ts, dur in kernels]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(tmp_path)


def test_busy_time_and_idle_gaps(tmp_path):
    # gemm 0-50, fusion.1 40-60 (overlaps), gap 60-260 (200 us), gemm 260-300, gap 40 us, fusion.2 340-350
    s = summarize(_trace(tmp_path, [("gemm", 0, 50), ("fusion.1", 40, 20), ("gemm", 260, 40), ("fusion.2", 340, 10)]),
                  steps=2)
    assert s["kernel_us_per_step"] == 120 / 2 and s["busy_us_per_step"] == 110 / 2 and s["span_us_per_step"] == 350 / 2
    assert s["gaps_over"] == {"us": 100.0, "count": 1, "total_us": 200, "largest_us": [200]}
    top = {t["name"]: t for t in s["top"]}
    assert top["gemm"]["per_step"] == 1 and top["fusion"]["us_each"] == 15
    # the 40 us gap sits after gemm (ends 300) and before fusion.2; the 200 us one is counted apart
    assert s["short_gaps_us_per_step"] == 40 / 2
    assert s["gap_pairs"] == [dict(before="gemm", after="fusion", per_step=0.5, us_per_step=20.0, us_each=40.0)]


def test_memsets_are_counted_apart_from_kernels(tmp_path):
    s = summarize(_trace(tmp_path, [("gemm", 0, 50), ("Memset (Device)", 52, 2), ("fusion.1", 56, 4)]), steps=1)
    sized = summarize(_trace(tmp_path / "sized", [("gemm", 0, 50), ("Memset (Device)", 52, 2), ("fusion.1", 56, 4)],
                             args={"Memset (Device)": {"Memset_details": "kind:unknown num_bytes:4 async:0"}}), steps=1)
    assert sized["memsets_before"][0]["sizes"] == ["4 B"]
    assert s["kernels_per_step"] == 2 and s["memsets_per_step"] == 1 and s["memset_us_per_step"] == 2
    assert s["gap_pairs"][0]["before"] == "gemm" and s["gap_pairs"][0]["us_each"] == 6
    # the memset (52-54) is followed by fusion.1 at 56: 2 us of idle after it
    assert s["memsets_before"] == [dict(before="fusion", per_step=1.0, idle_us_each=2.0, sizes=["?"])]


def test_a_gap_is_charged_to_the_kernel_that_ended_last(tmp_path):
    # long 0-100 overlaps short 10-20; the gap 100-103 follows long, not short (which started later)
    s = summarize(_trace(tmp_path, [("long", 0, 100), ("short", 10, 10), ("next", 103, 5)]), steps=1)
    assert s["gap_pairs"] == [dict(before="long", after="next", per_step=1.0, us_per_step=3.0, us_each=3.0)]


def test_no_device_kernels(tmp_path):
    assert "error" in summarize(_trace(tmp_path, []), steps=1)


def test_request_timeline_on_one_clock(tmp_path):
    """request_timeline: host scopes of at least min_us in start order and the device's first copy, first kernel
    and last kernel end, in us from the first host event (the hand-made trace's host work starts at 0)."""
    t = request_timeline(_trace(tmp_path, [("MemcpyH2D", 100, 4), ("gemm", 3000, 500), ("fusion.1", 3600, 50),
                                           ("MemcpyD2H", 4000, 2)]), min_us=40)
    assert [r["name"] for r in t["host"]] == ["host work"]
    assert t["device_first"] == dict(name="MemcpyH2D", start_us=100)
    assert (t["first_kernel_us"], t["last_kernel_end_us"]) == (3000, 3650)
    assert [c["name"] for c in t["copies"]] == ["MemcpyH2D", "MemcpyD2H"]
    assert request_timeline(_trace(tmp_path / "cpu", []))["device_first"] is None   # no device activity
