"""Run a bench script with some kernel tables changed in its process: an in-step A/B of a config without editing
jaxinfer/pallas/tables.py.

    PYTHONPATH=. python3 experiments/with_tables.py 'GEMV_ROWS[(5120, 2048)] = 4' ... -- bench/decode.py ARGS...

Each assignment is executed in tables' namespace before the script runs (as __main__); a statement that imports a
module and replaces one of its functions patches that too (gpu_round_next.sh part 42). The engine's executable
cache keys its steps by the tables and the package's source, not by a patched function: run such a process with a
HOME of its own (its own ~/.cache/jaxinfer).
"""

import runpy
import sys

from jaxinfer.pallas import tables

if __name__ == "__main__":
    split = sys.argv.index("--")
    for assignment in sys.argv[1:split]:
        exec(assignment, vars(tables))
        print(f"# tables: {assignment}", flush=True)
    sys.argv = sys.argv[split + 1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
