"""Prometheus metrics for /metrics, each server with its own registry.

Gauges are read when scraped, from the snapshot the engine thread publishes after every step
(running and waiting requests, KV pages in use, prefix-cache hit rate). Latencies are measured
on the event loop, where the client sees them: time to first token from the request's arrival,
time per output token over the rest of the request, end-to-end latency.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxinfer.engine.engine import STEP_PHASES
from jaxinfer.serve.async_engine import THREAD_PHASES

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

_LAG_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
LAG_PROBE_S = 0.005

CONTENT_TYPE = CONTENT_TYPE_LATEST


async def probe_loop_lag(observe) -> None:
    """Sleep LAG_PROBE_S again and again on the running loop, observing how late each wake-up is."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(LAG_PROBE_S)
        observe(max(0.0, loop.time() - t - LAG_PROBE_S))


class StampReceived:
    """Plain ASGI middleware: stamps each HTTP request with the time it reached the app
    (`request.state.received_at`, perf_counter), before its body is read and validated."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["received_at"] = time.perf_counter()
        await self.app(scope, receive, send)


def handler_start(request, metrics: "Metrics | None") -> float:
    """perf_counter as a completion handler starts; with metrics on, the time since the request arrived (its body read
    and validated) observed as its parse time."""
    arrived = time.perf_counter()
    if metrics:
        metrics.parse_time.observe(arrived - getattr(request.state, "received_at", arrived))
    return arrived


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self._source = None

        def gauge(name: str, doc: str, key: str) -> Gauge:
            g = Gauge(name, doc, ["model_name"], registry=r)
            g.labels(**labels).set_function(lambda: self._read(key))
            return g

        gauge("jaxinfer_num_requests_running", "Requests in the running batch.", "running")
        gauge("jaxinfer_num_requests_waiting", "Requests waiting to be admitted.", "waiting")
        gauge("jaxinfer_kv_pages_in_use", "KV cache pages held by live sequences.", "pages_in_use")
        gauge("jaxinfer_kv_pages_total", "KV cache pages in the pool.", "pages_total")
        gauge("jaxinfer_kv_cache_usage_ratio", "Share of the KV cache pages in use.", "pages_usage")
        gauge("jaxinfer_prefix_cache_hit_rate", "Share of looked-up prompt blocks found in the prefix cache.",
              "prefix_cache_hit_rate")
        gauge("jaxinfer_engine_busy_seconds_total", "Seconds the engine thread spent working (steps, adds, aborts).",
              "engine_busy_seconds")
        gauge("jaxinfer_engine_device_wait_seconds_total",
              "Seconds of that the engine thread spent blocked on the device (the rest is host work).",
              "engine_device_wait_seconds")
        # speculative decoding (0 without it); vLLM's spec_decode_num_draft_tokens / num_accepted_tokens
        gauge("jaxinfer_spec_decode_num_draft_tokens_total", "Drafted tokens verified.", "spec_drafted")
        gauge("jaxinfer_spec_decode_num_accepted_tokens_total", "Drafted tokens accepted.", "spec_accepted")
        gauge("jaxinfer_spec_decode_mean_accepted_length",
              "Tokens a sequence gains per verify step that carried its drafts (accepted drafts + the target's).",
              "spec_mean_accepted_length")
        # structured output (engine/constraints.py): the host's bitmask work before constrained steps
        gauge("jaxinfer_structured_mask_seconds_total", "Seconds the host spent filling structured-output bitmasks.",
              "structured_mask_seconds")
        gauge("jaxinfer_structured_masks_total", "Structured-output bitmask rows filled (one a constrained token).",
              "structured_masks")
        phases = Gauge("jaxinfer_engine_phase_seconds_total",
                       "Seconds the engine thread spent in each phase of its loop (engine.STEP_PHASES, "
                       "async_engine.THREAD_PHASES): the host's work between device steps, and the waits.",
                       ["model_name", "phase"], registry=r)
        for phase in STEP_PHASES + THREAD_PHASES:
            phases.labels(**labels, phase=phase).set_function(lambda p=phase: self._read_phase(p))
        self.ttft = Histogram("jaxinfer_time_to_first_token_seconds", "Time from arrival to the first token.",
                              ["model_name"], buckets=_TTFT_BUCKETS, registry=r).labels(**labels)
        # The server's TTFT in three parts: waiting to be taken into the engine (behind the decode
        # dispatch in flight), the engine's steps up to the first token id, and its way back to the
        # event loop. (vLLM has the first two as request_queue_time / request_prefill_time.)
        self.queue_time = Histogram("jaxinfer_request_queue_time_seconds",
                                    "Time from arrival until the engine thread took the request in.",
                                    ["model_name"], buckets=_TTFT_BUCKETS, registry=r).labels(**labels)
        self.prefill_time = Histogram("jaxinfer_request_prefill_time_seconds",
                                      "Time from being taken in until the engine produced the first token.",
                                      ["model_name"], buckets=_TTFT_BUCKETS, registry=r).labels(**labels)
        self.parse_time = Histogram("jaxinfer_request_parse_seconds",
                                    "Time from the request reaching the app until its handler started (reading "
                                    "and validating the body).", ["model_name"], buckets=_TTFT_BUCKETS,
                                    registry=r).labels(**labels)
        self.handoff_time = Histogram("jaxinfer_first_token_handoff_seconds",
                                      "Time from the engine producing the first token until the event loop saw it.",
                                      ["model_name"], buckets=_TTFT_BUCKETS, registry=r).labels(**labels)
        self.prefill_steps = Histogram("jaxinfer_request_prefill_steps",
                                       "Engine steps from being taken in until the first token (prefill chunks, "
                                       "and the decode dispatch read back before them).", ["model_name"],
                                       buckets=(1, 2, 3, 4, 6, 8, 16, 32, 64), registry=r).labels(**labels)
        # A mixed (prefill) step, host work and device together, by its token bucket: from the later of its
        # launch and the previous mixed read-back to its own read-back (steps read back late count once).
        self._mixed_step = Histogram("jaxinfer_engine_mixed_step_seconds",
                                     "Time of a mixed (prefill) step on the engine thread, from the later of its "
                                     "launch and the previous mixed step's read-back to its read-back, by token bucket.",
                                     ["model_name", "tokens"], buckets=_TTFT_BUCKETS, registry=r)
        # How late the event loop wakes from a short sleep: a loop held up (by handler work, or by another
        # thread keeping the GIL) delays every request it serves, before and after the engine's part.
        self.loop_lag = Histogram("jaxinfer_event_loop_lag_seconds",
                                  f"How late the event loop wakes from a {LAG_PROBE_S * 1e3:g} ms sleep.", ["model_name"],
                                  buckets=_LAG_BUCKETS, registry=r).labels(**labels)
        # Python's garbage collections, by generation: each one holds the GIL (engine thread and event loop).
        self._gc_pause = Histogram("jaxinfer_gc_pause_seconds", "Duration of Python garbage collections, by generation.",
                                   ["model_name", "generation"], buckets=_LAG_BUCKETS, registry=r)
        self.tpot = Histogram("jaxinfer_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", ["model_name"],
                              buckets=_TPOT_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("jaxinfer_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             ["model_name"], buckets=_E2E_BUCKETS, registry=r).labels(**labels)
        self.generation_tokens = Counter("jaxinfer_generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=r).labels(**labels)
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "Prompt tokens submitted.", ["model_name"],
                                     registry=r).labels(**labels)
        self._finished = Counter("jaxinfer_request_success", "Requests finished, by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self._finished_labels = labels
        self.aborted = Counter("jaxinfer_request_aborted", "Requests cancelled (client gone).", ["model_name"],
                               registry=r).labels(**labels)
        self.rejected = Counter("jaxinfer_request_rejected", "Requests refused with 503 (queue full).",
                                ["model_name"], registry=r).labels(**labels)

    def bind(self, source) -> None:
        """Read the gauges from `source.snapshot` (the AsyncEngine's, a dict) when scraped."""
        self._source = source

    def _read(self, key: str) -> float:
        s = self._source.snapshot if self._source is not None else {}
        if key == "pages_usage":
            return s["pages_in_use"] / s["pages_total"] if s.get("pages_total") else 0.0
        return float(s.get(key, 0.0))

    def _read_phase(self, phase: str) -> float:
        s = self._source.snapshot if self._source is not None else {}
        return float(s.get("phases", {}).get(phase, 0.0))

    def on_submit(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_first_token(self, arrived: float, added: float | None, produced: float | None, seen: float,
                       steps: int = 0) -> None:
        self.ttft.observe(seen - arrived)
        if added is not None and produced is not None:
            self.queue_time.observe(added - arrived)
            self.prefill_time.observe(produced - added)
            self.handoff_time.observe(seen - produced)
            self.prefill_steps.observe(steps)

    def gc_pause(self, generation: int, seconds: float) -> None:
        self._gc_pause.labels(**self._finished_labels, generation=str(generation)).observe(seconds)

    def mixed_step(self, tokens: int, seconds: float) -> None:
        self._mixed_step.labels(**self._finished_labels, tokens=str(tokens)).observe(seconds)

    def on_finish(self, arrived: float, first: float | None, last: float | None, num_tokens: int,
                  reason: str | None) -> None:
        if last is not None:
            self.e2e.observe(last - arrived)
        if first is not None and last is not None and num_tokens > 1:
            self.tpot.observe((last - first) / (num_tokens - 1))
        self._finished.labels(**self._finished_labels, finished_reason=reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
