import json
import threading
import time

from jaxinfer.serve.host_profile import HostProfiler, shares


def _spin_here(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_the_profiler_finds_where_a_thread_spends_its_time(tmp_path):
    path = tmp_path / "profile.json"
    stop = threading.Event()
    worker = threading.Thread(target=_spin_here, args=(stop,), name="spinner")
    worker.start()
    prof = HostProfiler(str(path), interval=0.001, write_every=0.05).start()
    time.sleep(0.3)
    prof.stop()
    stop.set()
    worker.join()
    report = json.loads(path.read_text())
    spinner = shares(None, report, "spinner")
    assert spinner["samples"] >= 20
    assert spinner["total"]["test_host_profile.py:_spin_here"] > 0.9
    assert "jaxinfer-host-profiler" not in report["threads"]      # it does not sample itself
    assert shares(report, report, "spinner")["samples"] == 0
