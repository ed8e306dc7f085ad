"""bench/quality.py end to end on the CPU at a small size: one story, stories260k, every configuration."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_quality_report_runs_and_int8_stays_close(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "bench" / "quality.py"), "--models", "stories260k", "--windows", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["configuration"]: row for row in json.loads((tmp_path / "quality.json").read_text())["rows"]}
    assert all("error" not in row for row in rows.values()), rows
    assert {"int8 weights", "fp8 weights"} <= set(rows) and "| stories260k | int8 weights |" in r.stdout
    int8 = rows["int8 weights"]
    assert int8["positions"] > 200 and int8["kl"] < 0.005 and int8["top1"] > 0.95, int8
    assert all(row["kl"] >= 0 and 0.9 < row["ppl_ratio"] < 1.2 for row in rows.values()), rows
    w8a8 = rows["int8 W8A8"]   # each row of x in int8 too: closer than fp8 weights alone on this model
    assert w8a8["kl"] < min(0.01, rows["fp8 weights"]["kl"]) and w8a8["top1"] > 0.93, w8a8
