"""The GPU-only tests (tests/gpu, which CI ignores: they need an NVIDIA GPU) import and collect on the CPU, so that a
device call is never lost to an import error or a parametrization that no longer builds."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_tests_collect_on_the_cpu():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                        "no:cacheprovider", "tests/gpu"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = {line.split("::")[0] for line in r.stdout.splitlines() if "::" in line}
    assert files == {str(p.relative_to(REPO)) for p in (REPO / "tests" / "gpu").glob("test_*.py")}, files
