"""Which HLO a fusion named in a trace holds: reads XLA's optimized-HLO dumps (--xla_dump_to) and prints, for
each module that has it, how often `name` is called and the body of its fused computation.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" python3 bench/decode_dispatch.py ...
    python3 bench/hlo_fusions.py /tmp/dump loop_broadcast_multiply_fusion [more names]
"""

from __future__ import annotations

import glob
import os
import re
import sys


def main() -> None:
    folder, names = sys.argv[1], sys.argv[2:]
    for path in sorted(glob.glob(os.path.join(folder, "*after_optimizations.txt"))):
        text = open(path).read()
        for name in names:
            calls = [ln.strip() for ln in text.splitlines() if re.search(rf"%{name}(\.\d+)? = ", ln)]
            if not calls:
                continue
            print(f"## {os.path.basename(path)}: {name} called {len(calls)} times")
            for ln in calls[:3]:
                print("   ", ln[:400])
            comp = re.search(r"calls=%?([\w.\-]+)", calls[0])
            if comp:
                body = re.search(rf"\n(%?{re.escape(comp.group(1))} .*?\n}})", text, re.S)
                if body:
                    print("\n".join("    " + b[:300] for b in body.group(1).splitlines()[:25]))


if __name__ == "__main__":
    main()
