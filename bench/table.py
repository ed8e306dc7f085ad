"""The markdown table the benches print last: one row per result, a failed row keeps its error."""

from __future__ import annotations


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (header, key, format spec) each; the first column is printed as is, and a row with
    an `error` gets it in the second column."""
    print("| " + " | ".join(h for h, _, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        first = r[columns[0][1]]
        if "error" in r:
            cells = [str(first), f"failed: {str(r['error'])[:100]}"] + [""] * (len(columns) - 2)
        else:
            cells = [str(first)] + [format(r[k], f) for _, k, f in columns[1:]]
        print("| " + " | ".join(cells) + " |")
