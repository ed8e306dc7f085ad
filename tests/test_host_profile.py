"""The host profiler's counts, without timing: samples are taken by calling `sample()` (or by the
profiler's thread until a count is reached), never by sleeping for a while and hoping."""

import json
import threading
import time

from jaxinfer.serve.host_profile import HostProfiler, shares


def _spin_here(started: threading.Event, stop: threading.Event) -> None:
    started.set()
    while not stop.is_set():
        sum(range(1000))


def _spinner():
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=_spin_here, args=(started, stop), name="spinner")
    worker.start()
    started.wait()   # from here on every stack of the thread has _spin_here in it
    return worker, stop


def test_the_profiler_finds_where_a_thread_spends_its_time(tmp_path):
    path = tmp_path / "profile.json"
    worker, stop = _spinner()
    prof = HostProfiler(str(path))
    try:
        for _ in range(20):
            prof.sample()
    finally:
        stop.set()
        worker.join()
    prof.write()
    report = json.loads(path.read_text())
    spinner = shares(None, report, "spinner")
    assert spinner["samples"] == 20 and spinner["idle"] == 0
    assert spinner["total"]["test_host_profile.py:_spin_here"] == 1.0
    assert shares(report, report, "spinner")["samples"] == 0
    assert shares(None, report, "no such thread") == dict(samples=0, idle=0, self={}, total={})


def test_the_profiler_thread_does_not_sample_itself(tmp_path):
    path = tmp_path / "profile.json"
    worker, stop = _spinner()
    prof = HostProfiler(str(path), interval=0.001, write_every=0.01).start()
    try:
        deadline = time.monotonic() + 600   # only against a hang: any machine, however loaded, gets there
        while prof.samples["spinner"] < 5:
            assert time.monotonic() < deadline, "the profiler's thread took no samples"
            time.sleep(0.01)
    finally:
        prof.stop()
        stop.set()
        worker.join()
    report = json.loads(path.read_text())
    assert report["threads"]["spinner"]["samples"] >= 5
    assert "jaxinfer-host-profiler" not in report["threads"]
