"""Digests of the Triton IR that the lowering tests produce, to show that a refactor left the kernels as they were.

    PYTHONPATH=. python3 tools/triton_ir_digest.py --save before.txt [pytest args]    # on the old code
    PYTHONPATH=. python3 tools/triton_ir_digest.py --against before.txt [pytest args] # on the new code

The pytest args default to the tests that lower for CUDA on the CPU (tests/test_triton_lowering.py and the
`lower` tests beside the kernels). Every Pallas Triton kernel a test lowers is recorded as its Triton module's
text without debug locations (which name source lines, so any edit above a kernel would move them), and a test's
digest hashes its modules in order. `--against` prints the tests whose kernels changed and exits 1 if any did.
Mosaic GPU kernels (hopper_gemm, hopper_attention) are not seen: they do not lower through Triton.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import pytest

DEFAULT = ["tests/test_triton_lowering.py", "tests/test_pallas_verify_attention.py", "tests/test_kv_cache_int8.py",
           "tests/test_moe.py", "tests/test_moe_quantized.py", "tests/test_pallas_grouped_gemm.py",
           "tests/test_pallas_prefill_attention.py", "tests/test_pallas_quantized_gemv.py",
           "tests/test_pallas_sliding_window.py", "-k", "lower"]


class Recorder:
    """A pytest plugin: the Triton modules lowered during each test, by node id."""

    def __init__(self):
        self.modules: dict[str, list[str]] = {}
        self.current: str | None = None

    def pytest_sessionstart(self, session):
        import jax._src.pallas.triton.pallas_call_registration as registration

        lower = registration.lowering.lower_jaxpr_to_triton_module

        def recording(*args, **kwargs):
            result = lower(*args, **kwargs)
            if self.current is not None:
                text = result.module.operation.get_asm(enable_debug_info=False)
                self.modules.setdefault(self.current, []).append(text)
            return result

        registration.lowering.lower_jaxpr_to_triton_module = recording

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        self.current = item.nodeid
        yield
        self.current = None

    def digests(self) -> dict[str, str]:
        return {node: f"{len(mods)} {hashlib.sha256(chr(0).join(mods).encode()).hexdigest()[:16]}"
                for node, mods in self.modules.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", type=Path, help="write the digests here")
    ap.add_argument("--against", type=Path, help="compare with digests saved by --save")
    args, rest = ap.parse_known_args()
    recorder = Recorder()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", *(rest or DEFAULT)], plugins=[recorder])
    if rc != 0:
        print(f"pytest exited {rc}: the digests are of the tests that ran", file=sys.stderr)
    digests = recorder.digests()
    lines = [f"{node}  {digest}" for node, digest in sorted(digests.items())]
    if args.save:
        args.save.write_text("\n".join(lines) + "\n")
    print(f"{len(digests)} tests lowered {sum(len(m) for m in recorder.modules.values())} Triton modules")
    if not args.against:
        return int(rc != 0)
    saved = dict(line.split("  ", 1) for line in args.against.read_text().splitlines() if line)
    changed = sorted(n for n in saved.keys() | digests.keys() if saved.get(n) != digests.get(n))
    for node in changed:
        print(f"changed: {node}  {saved.get(node, '-')} -> {digests.get(node, '-')}")
    print("the same Triton IR in every test" if not changed else f"{len(changed)} tests' Triton IR changed")
    return int(bool(changed) or rc != 0)


if __name__ == "__main__":
    sys.exit(main())
