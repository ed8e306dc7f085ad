"""Where a one-shot start goes: imports, device start, Engine(...) and the first token, in one process under
cProfile (the top functions by cumulative and own time are printed).

    PYTHONPATH=. python3 experiments/start_profile.py MODEL_DIR CACHE_DIR [--no-profile]
"""

import time

T0 = time.perf_counter()
import cProfile  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402

prof = cProfile.Profile()
profiling = "--no-profile" not in sys.argv
if profiling:
    prof.enable()
import jax  # noqa: E402

t_import = time.perf_counter()
jax.devices()
t_devices = time.perf_counter()
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.engine.llm import stream  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402

t_import2 = time.perf_counter()
engine = Engine(sys.argv[1], cache_dir=sys.argv[2], max_num_seqs=1)
t_engine = time.perf_counter()
deltas = stream(engine, "1 2 3 4 5", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
next(deltas)
t_first = time.perf_counter()
for _ in deltas:
    pass
t_done = time.perf_counter()
prof.disable()
print(engine.summary)
print(f"import jax {t_import - T0:.2f} s | devices {t_devices - t_import:.2f} | import jaxinfer {t_import2 - t_devices:.2f} | "
      f"Engine() {t_engine - t_import2:.2f} | first token {t_first - t_engine:.2f} | 15 more {t_done - t_first:.2f} | "
      f"total to first token {t_first - T0:.2f} s")
if profiling:
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(25)
