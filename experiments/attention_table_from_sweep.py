"""The batch-1 long-context row of an attention table set to a kernel sweep's winner, as an assignment for
experiments/with_tables.py (the in-step A/B of the sweep's best config, without editing tables.py).

    python3 experiments/attention_table_from_sweep.py $OUT/decode_attention_rope.json [--table DECODE_ATTENTION_INT8]

Reads bench/kernels/decode_attention_rope.py's JSON (its first point, batch 1), takes the fastest config whose
output was right, and prints `TABLE = [... the (8, _BIG) row replaced ...]`; nothing (exit 1) if no config passed.
"""

import json
import sys

if __name__ == "__main__":
    # sys.argv, not argparse: the dry run (experiments/dry_run.sh) stops every argparse at its parse, and this
    # script's output is an argument of the next step
    path, table = sys.argv[1], sys.argv[3] if sys.argv[2:3] == ["--table"] else "DECODE_ATTENTION_INT8"
    point = json.load(open(path))["points"][0]
    good = sorted((r for r in point["rows"] if r.get("ok")), key=lambda r: r["us"])
    if point["B"] != 1 or not good:
        sys.exit(1)
    cfg = ", ".join(f"{k}={v!r}" for k, v in good[0]["cfg"].items())
    print(f"{table} = [(sh, span, SplitConfig({cfg}) if (sh, span) == (8, _BIG) else c) for sh, span, c in {table}]")
