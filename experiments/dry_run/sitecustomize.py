"""Imported by Python at start-up when this folder is on PYTHONPATH (experiments/dry_run.sh puts it there): every
argparse parser exits 0 right after parsing, so a device round's commands (and experiments/with_tables.py's
assignments, which run before the script parses) are checked on the CPU without running anything."""

import argparse
import sys

_parse_args = argparse.ArgumentParser.parse_args


def _parse_and_exit(self, *args, **kwargs):
    namespace = _parse_args(self, *args, **kwargs)
    print(f"dry run: {sys.argv[0]} parsed: {namespace}", flush=True)
    raise SystemExit(0)


argparse.ArgumentParser.parse_args = _parse_and_exit
