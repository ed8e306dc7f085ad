#!/usr/bin/env bash
# Check a device round's commands on the CPU before spending device time on them: every step of
#   bash experiments/dry_run.sh experiments/gpu_round_next.sh 10
# runs with argparse exiting right after it parses (experiments/dry_run/sitecustomize.py), so a wrong flag, a bad
# table assignment or a missing script shows as rc != 0. pytest steps stop at pytest's own parser.
set -u
script=$1; shift
export OUT=${OUT:-/tmp/dry_run_out}
sed -E "s#PYTHONPATH=\.(:/tmp/pylibs)?( |\$)#PYTHONPATH=.\1:$PWD/experiments/dry_run\2#" "$script" > "$OUT.sh"
grep -q "experiments/dry_run" "$OUT.sh" || { echo "dry run: no PYTHONPATH=. export found in $script"; exit 2; }
bash "$OUT.sh" "$@" 2>&1 | grep -E '^## |^dry run: |Error' | cut -c1-240
