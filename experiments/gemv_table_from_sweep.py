"""The 8-bit GEMV tables' rows for one model shape from a `bench/kernels/quantized_gemv.py --sweep` JSON: the fastest
int8 config of each projection, printed one `experiments/with_tables.py` assignment a line (for a whole-step A/B):

    mapfile -t V < <(python3 experiments/gemv_table_from_sweep.py $OUT/quantized_gemv.json --shape llama3-8b)
    python3 experiments/with_tables.py "${V[@]}" -- bench/decode.py ...

The tables are keyed as fused_gemv looks them up: (out rows, in columns), the SwiGLU kernel by its gate rows."""

import argparse
import json
import re

PATTERN = re.compile(r"block_in (\d+), rows (\d+)(?:, (\w+))?(?:, (\d+) warps)?$")


def assignments(data: dict, shape: str, fmt: str = "int8") -> list[str]:
    best: dict[str, dict] = {}
    for row in data["gemv"]:
        if row["shape"] != shape or row["format"] != fmt or not PATTERN.match(row["config"]):
            continue
        if row["projection"] not in best or row["us"] < best[row["projection"]]["us"]:
            best[row["projection"]] = row
    out = []
    for projection, row in best.items():
        n, k = (int(d) for d in row["dims"].split("x"))
        if projection == "gate/up":
            n //= 2
        block_in, rows, convert, warps = PATTERN.match(row["config"]).groups()
        key = f"({n}, {k})"
        out += [f"GEMV_BLOCK_IN_8BIT[{key}] = {block_in}", f"GEMV_ROWS_8BIT[{key}] = {rows}",
                f"GEMV_WARPS_8BIT[{key}] = {warps or 1}"]
        if convert and fmt == "int8":
            out.append(f"GEMV_INT8_CONVERT_BY_SHAPE[{key}] = '{convert}'")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--shape", required=True)
    ap.add_argument("--format", default="int8", choices=["int8", "fp8"])
    args = ap.parse_args()
    lines = assignments(json.load(open(args.json)), args.shape, args.format)
    if not lines:
        raise SystemExit(f"no swept {args.format} GEMV of {args.shape} in {args.json}")
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
