"""Run a bench script's variants each in its own process (XLA reads its flags once per process).

The child prints one line `RESULT {json}`; its table rows (`|...`) and profile lines are echoed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_variants(script: str, variants: dict[str, str], child_args: list[str], timeout: float) -> list[dict]:
    """For each variant name -> XLA_FLAGS, run `script --child NAME *child_args` with those flags
    added; returns one row per variant: its RESULT fields, or `error`."""
    rows = []
    for name, flags in variants.items():
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}
        cmd = [sys.executable, script, "--child", name, *child_args]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            out = p.stdout + p.stderr
            line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else dict(error=out.strip().splitlines()[-1][:200] if out.strip() else "?")
            print(f"# {name}: {json.dumps(res)}", flush=True)
            print("\n".join(l for l in p.stdout.splitlines() if l.startswith(("|", "# profile"))), flush=True)
        except subprocess.TimeoutExpired:
            res = dict(error="timeout")
        rows.append(dict(variant=name, flags=flags, **res))
    return rows
