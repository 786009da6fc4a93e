"""Prometheus metrics (one registry per app) and a short history for the dashboard.

Latency histograms are observed as requests stream (TTFT as the client sees it from the
daemon, the gap between tokens, the whole request, the wait for a slot). Engine-side numbers
(slots, queue, prefix cache) come from the workers' stats, snapshotted at scrape time. A
sampler task keeps a ring buffer of recent points for the dashboard's charts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmd.backends.base import Usage

log = logging.getLogger("llmd.metrics")
LABELS = ("model", "backend", "api")
WINDOW_MAX = 10_000  # requests between two history points (2 s) beyond this are not summarised
SAMPLER_LOG_EVERY_S = 60.0
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self, is_model: Callable[[str], bool] = lambda _name: True) -> None:
        # only registered models become label values: each unknown name sent by a client would
        # otherwise add a time series for good (2,000 names grew /metrics to 16.5 MB)
        self.is_model = is_model
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("llmd_time_to_first_token_seconds", "Request received to first token sent",
                              LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("llmd_inter_token_latency_seconds", "Gap between consecutive streamed pieces",
                             LABELS, buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("llmd_request_duration_seconds", "Request received to last token",
                                  LABELS, buckets=DURATION_BUCKETS, registry=r)
        self.queue_wait = Histogram("llmd_queue_wait_seconds", "Time a request waited for a slot",
                                    LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llmd_prompt_tokens", "Prompt tokens processed", LABELS, registry=r)
        self.cached_tokens = Counter("llmd_cached_prompt_tokens", "Prompt tokens reused from a cache", LABELS,
                                     registry=r)
        self.generated_tokens = Counter("llmd_generated_tokens", "Tokens generated", LABELS, registry=r)
        self.drafted_tokens = Counter("llmd_drafted_tokens", "Tokens proposed by speculation", LABELS, registry=r)
        self.accepted_tokens = Counter("llmd_accepted_tokens", "Drafted tokens the target accepted", LABELS,
                                       registry=r)
        self.dropped_messages = Counter("llmd_dropped_messages", "Old chat messages left out to fit the context "
                                        "(Ollama's API)", LABELS, registry=r)
        self.dropped_by_model: dict[str, int] = {}  # the same count, for /llmd/status
        self.requests = Counter("llmd_requests", "Requests by outcome", (*LABELS, "outcome"), registry=r)
        self.response_cache = Counter("llmd_response_cache", "Response cache lookups", ("result",), registry=r)
        self.running = Gauge("llmd_requests_running", "Requests admitted and not finished", registry=r)
        self._snapshot: dict[str, Any] = {}
        r.register(_EngineCollector(self))
        self.history: deque[dict[str, Any]] = deque(maxlen=360)  # 12 minutes at one point per 2 s
        # requests finished since the last history point; bounded, should the sampler stop draining it
        self._window: deque[tuple[float, float, int, float, int, int, int, int, int]] = deque(maxlen=WINDOW_MAX)
        self.sampler_errors = 0
        self._sampler_logged = 0.0
        self._process = psutil.Process()
        self._process.cpu_percent()

    # ---- observations -------------------------------------------------------------------------

    def observe(self, model: str, api: str, outcome: str, ttft: float | None, gaps: list[float],
                duration: float, usage: Usage | None, cache: str, backend: str = "llama.cpp") -> None:
        labels = (model if self.is_model(model) else "(unregistered)", backend, api)
        self.requests.labels(*labels, outcome).inc()
        if cache in ("hit", "miss"):
            self.response_cache.labels(cache).inc()
        if ttft is not None:
            self.ttft.labels(*labels).observe(ttft)
        itl = self.itl.labels(*labels)
        for g in gaps:
            itl.observe(g)
        self.duration.labels(*labels).observe(duration)
        if usage is not None:
            self.prompt_tokens.labels(*labels).inc(usage.prompt_tokens)
            self.cached_tokens.labels(*labels).inc(usage.cached_tokens)
            self.generated_tokens.labels(*labels).inc(usage.completion_tokens)
            if usage.dropped_messages and cache != "hit":
                self.dropped_messages.labels(*labels).inc(usage.dropped_messages)
                self.dropped_by_model[labels[0]] = self.dropped_by_model.get(labels[0], 0) + usage.dropped_messages
            if cache != "hit":  # a replay from the response cache drafted nothing and waited for no slot
                self.drafted_tokens.labels(*labels).inc(usage.drafted_tokens)
                self.accepted_tokens.labels(*labels).inc(usage.accepted_tokens)
                self.queue_wait.labels(*labels).observe(usage.queue_s)
        tps = usage.decode_tps if usage is not None and cache != "hit" else 0.0
        self._window.append((time.time(), ttft or 0.0, 1 if cache == "hit" else 0, tps,
                             usage.cached_tokens if usage else 0, usage.prompt_tokens if usage else 0,
                             usage.completion_tokens if usage else 0,
                             usage.drafted_tokens if usage and cache != "hit" else 0,
                             usage.accepted_tokens if usage and cache != "hit" else 0))

    def set_snapshot(self, status: dict[str, Any]) -> None:
        self._snapshot = status
        self.running.set(status.get("requests_in_flight", 0))  # read at each scrape, as the status has it

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- history for the dashboard --------------------------------------------------------------

    def sample(self, status: dict[str, Any]) -> dict[str, Any]:
        """One history point from the requests finished since the last one, plus live state."""
        window, self._window = list(self._window), deque(maxlen=WINDOW_MAX)
        self.set_snapshot(status)
        ttfts = sorted(w[1] for w in window if w[2] == 0)
        tps = [w[3] for w in window if w[3] > 0]
        prompt = sum(w[5] for w in window)
        drafted = sum(w[7] for w in window)
        loaded = status.get("loaded", [])
        stats = [m.get("stats") or {} for m in loaded]
        pc = [s.get("prefix_cache") or {} for s in stats]
        point = {
            "t": time.time(),
            "requests": len(window),
            "ttft_p50": _pct(ttfts, 0.5),
            "ttft_p95": _pct(ttfts, 0.95),
            "tokens_per_s": sum(tps) / len(tps) if tps else None,
            "generated": sum(w[6] for w in window),
            "response_cache_hit_rate": (sum(w[2] for w in window) / len(window)) if window else None,
            "prefix_reuse_rate": (sum(w[4] for w in window) / prompt) if prompt else None,
            "prefix_hits": sum(p.get("hits", 0) for p in pc),
            "draft_acceptance": sum(w[8] for w in window) / drafted if drafted else None,
            "slots_busy": sum(s.get("slots_busy", 0) for s in stats),
            "slots": sum(s.get("slots", 0) for s in stats),
            "waiting": sum(s.get("waiting", 0) for s in stats),
            "models": [m["name"] for m in loaded],
        }
        self.history.append(point)
        return point

    async def run_sampler(self, status_fn: Any, period: float = 2.0) -> None:
        while True:
            try:
                self.sample(await status_fn())
            except Exception:  # the dashboard must never take the daemon down, nor hide why it is blank
                self.sampler_errors += 1
                now = time.monotonic()
                if now - self._sampler_logged >= SAMPLER_LOG_EVERY_S:
                    self._sampler_logged = now
                    log.exception("dashboard sampler failed (%d times so far); the charts miss these points",
                                  self.sampler_errors)
            await asyncio.sleep(period)


def _pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


class _EngineCollector:
    """Gauges and counters read from the latest status snapshot at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Any:
        status = self.m._snapshot
        loaded = status.get("loaded", [])
        g = GaugeMetricFamily("llmd_slots_busy", "Slots decoding or prefilling", labels=["model", "backend"])
        w = GaugeMetricFamily("llmd_requests_waiting", "Requests waiting for a slot", labels=["model", "backend"])
        hits = CounterMetricFamily("llmd_prefix_cache_hits", "Prompts that restored a prefix from disk",
                                   labels=["model", "backend"])
        misses = CounterMetricFamily("llmd_prefix_cache_misses", "Prompts with no stored prefix",
                                     labels=["model", "backend"])
        restored = CounterMetricFamily("llmd_prefix_cache_tokens_restored", "Tokens restored from disk",
                                       labels=["model", "backend"])
        threads = GaugeMetricFamily("llmd_threads", "llama.cpp threads in use (fewer while other programs keep "
                                    "cores busy)", labels=["model", "backend"])
        others = GaugeMetricFamily("llmd_other_programs_cores", "Cores other programs kept busy at the last check",
                                   labels=["model", "backend"])
        for m in loaded:
            st = m.get("stats") or {}
            lab = [m["name"], m.get("engine", "llama.cpp")]
            g.add_metric(lab, st.get("slots_busy", 0))
            w.add_metric(lab, st.get("waiting", 0))
            pc = st.get("prefix_cache") or {}
            hits.add_metric(lab, pc.get("hits", 0))
            misses.add_metric(lab, pc.get("misses", 0))
            restored.add_metric(lab, pc.get("tokens_restored", 0))
            if st.get("threads"):
                threads.add_metric(lab, st["threads"]["threads"])
                others.add_metric(lab, st["threads"]["others_cores"])
        yield g
        yield w
        yield hits
        yield misses
        yield restored
        yield threads
        yield others
        yield GaugeMetricFamily("llmd_models_loaded", "Models loaded", value=len(loaded))
        proc = self.m._process
        yield GaugeMetricFamily("llmd_process_resident_memory_bytes", "Daemon RSS", value=proc.memory_info().rss)
        workers_rss = 0
        for m in loaded:
            try:
                workers_rss += psutil.Process(m["pid"]).memory_info().rss
            except (psutil.Error, KeyError, TypeError):
                pass
        yield GaugeMetricFamily("llmd_workers_resident_memory_bytes", "Engine workers' RSS", value=workers_rss)
        yield GaugeMetricFamily("llmd_process_cpu_percent", "Daemon CPU use since the last scrape",
                                value=proc.cpu_percent())
        gpu = _gpu()
        if gpu:
            u = GaugeMetricFamily("llmd_gpu_utilization_percent", "GPU utilization", labels=["gpu"])
            mem = GaugeMetricFamily("llmd_gpu_memory_used_bytes", "GPU memory used", labels=["gpu"])
            for i, (util, used) in enumerate(gpu):
                u.add_metric([str(i)], util)
                mem.add_metric([str(i)], used)
            yield u
            yield mem


@functools.cache
def _nvml() -> Any:
    """pynvml, initialised once for the daemon's life (nvmlInit on every scrape cost a driver
    round trip each time); None when NVML or a driver is absent."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _gpu() -> list[tuple[float, int]]:
    """(utilization %, memory used) per NVIDIA GPU, or [] when NVML or a driver is absent."""
    pynvml = _nvml()
    if pynvml is None:
        return []
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        out.append((float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu), int(pynvml.nvmlDeviceGetMemoryInfo(h).used)))
    return out
