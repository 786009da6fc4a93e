"""Per-step timing for LLMD_PROFILE=1: where a step's time goes (batch build, decode, sampling,
detokenize, IPC). Off by default: then `span` is a shared no-op and costs one attribute lookup.
On GPU backends, the same spans become NVTX ranges when the `nvtx` package is installed, so
Nsight Systems timelines show prefill and decode."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any


class Profiler:
    def __init__(self, enabled: bool, nvtx_ranges: bool = False) -> None:
        self.enabled = enabled
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._nvtx: Any = None
        if enabled and nvtx_ranges:
            try:
                import nvtx

                self._nvtx = nvtx
            except ImportError:
                pass

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + 1

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        rng = self._nvtx.start_range(message=name) if self._nvtx else None
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)
            if rng is not None:
                self._nvtx.end_range(rng)

    def summary(self) -> dict[str, Any]:
        if not self.enabled:
            return {"enabled": False}
        return {"enabled": True, **{
            name: {"count": self.counts[name], "total_s": round(total, 4),
                   "mean_ms": round(total / self.counts[name] * 1000, 3)}
            for name, total in sorted(self.totals.items())}}
