"""Admission, queue bounds, cancellation, and routing requests to the loaded engine worker.

State: workers by model name (at most `max_loaded` kept; others retire when their last
request finishes), one load in flight per model (concurrent requests share it), and the count
of admitted requests, bounded by slots + max_queue. Back-pressure is a typed error
(Overloaded -> 503 with Retry-After), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmd.backends.base import EngineConfig, ErrorEvent, Event, FinalEvent, GenerationRequest
from llmd.backends.worker import WorkerHandle
from llmd.config import Settings
from llmd.errors import Overloaded, from_wire
from llmd.models.registry import Registry

log = logging.getLogger("llmd.scheduler")

WorkerFactory = Callable[[str, EngineConfig, asyncio.AbstractEventLoop, Callable[[WorkerHandle], None]], WorkerHandle]


class Scheduler:
    def __init__(self, settings: Settings, registry: Registry, worker_factory: WorkerFactory = WorkerHandle,
                 max_loaded: int = 1) -> None:
        self.settings = settings
        self.registry = registry
        self._factory = worker_factory
        self.max_loaded = max_loaded
        self.workers: dict[str, WorkerHandle] = {}
        self._loads: dict[str, asyncio.Task[WorkerHandle]] = {}
        self.active_model = settings.model
        self.in_flight = 0
        self.capacity = settings.slots + settings.max_queue
        self.started = time.time()
        self.crashes = 0

    # ---- loading ------------------------------------------------------------------------------

    async def worker_for(self, model: str | None) -> tuple[WorkerHandle, float]:
        """The loaded worker of `model` (loading it if needed) and the seconds spent loading."""
        name = model or self.active_model
        worker = self.workers.get(name)
        if worker is not None and worker.alive and worker.info:
            return worker, 0.0
        row = self.registry.get(name)  # ModelNotFound before anything starts
        t0 = time.perf_counter()
        task = self._loads.get(name)
        if task is None:
            task = asyncio.ensure_future(self._load(name, row))
            self._loads[name] = task
            task.add_done_callback(lambda _t, n=name: self._loads.pop(n, None))
        worker = await asyncio.shield(task)
        return worker, time.perf_counter() - t0

    async def _load(self, name: str, row: dict[str, Any]) -> WorkerHandle:
        s = self.settings
        cfg = EngineConfig(model_path=row["path"], model_name=name, n_ctx=s.ctx, n_slots=s.slots,
                           chunk=s.chunk, threads=s.threads, gpu_layers=s.gpu_layers)
        loop = asyncio.get_running_loop()
        worker = self._factory("llama.cpp", cfg, loop, self._on_exit)
        try:
            await worker.wait_loaded()
        except BaseException:
            await asyncio.to_thread(worker.shutdown)
            raise
        self.workers[name] = worker
        log.info("loaded %s in worker pid %s (%.2fs)", name, worker.pid, worker.info.get("load_s", 0))
        self._retire_idle(keep=name)
        return worker

    def _on_exit(self, worker: WorkerHandle) -> None:
        name = worker.cfg.model_name
        if self.workers.get(name) is worker:
            del self.workers[name]
            if worker.process.exitcode not in (0, None):
                self.crashes += 1

    def _retire_idle(self, keep: str | None = None) -> None:
        """Stop workers beyond max_loaded once they have no open requests."""
        keep = keep or self.active_model
        extra = [n for n in self.workers if n != keep]
        while len(self.workers) > self.max_loaded and extra:
            name = extra.pop(0)
            worker = self.workers[name]
            if worker.open_requests == 0:
                del self.workers[name]
                asyncio.get_running_loop().run_in_executor(None, worker.shutdown)

    # ---- generation ---------------------------------------------------------------------------

    async def generate(self, model: str | None, req: GenerationRequest,
                       timing: dict[str, float] | None = None) -> AsyncIterator[Event]:
        """Events of one request, ending with a FinalEvent; an ErrorEvent is raised as its LlmdError.
        Closing the iterator early (client gone) cancels the request in the engine."""
        if self.in_flight >= self.capacity:
            raise Overloaded(
                f"{self.in_flight} requests are running or queued (limit {self.capacity}: "
                f"{self.settings.slots} slots + {self.settings.max_queue} queued); retry shortly",
                retry_after=1,
            )
        self.in_flight += 1
        try:
            worker, load_s = await self.worker_for(model)
            if timing is not None:
                timing["load_s"] = load_s
            queue = worker.submit(req)
            finished = False
            try:
                while True:
                    ev = await queue.get()
                    if isinstance(ev, ErrorEvent):
                        finished = True
                        raise from_wire(ev.error)
                    yield ev
                    if isinstance(ev, FinalEvent):
                        finished = True
                        return
            finally:
                if finished:
                    worker.forget(req.id)
                else:
                    worker.cancel(req.id)
        finally:
            self.in_flight -= 1
            if len(self.workers) > self.max_loaded:
                self._retire_idle()

    # ---- status and shutdown ------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        loaded = []
        for name, w in list(self.workers.items()):
            stats = await w.stats()
            loaded.append({"name": name, "pid": w.pid, "since": w.started, "open_requests": w.open_requests,
                           **{k: v for k, v in w.info.items() if k not in ("pid",)}, "stats": stats})
        return {
            "active_model": self.active_model,
            "loaded": loaded,
            "loading": sorted(self._loads),
            "requests_in_flight": self.in_flight,
            "capacity": self.capacity,
            "worker_crashes": self.crashes,
        }

    async def close(self) -> None:
        for task in list(self._loads.values()):
            task.cancel()
        workers, self.workers = list(self.workers.values()), {}
        await asyncio.gather(*(asyncio.to_thread(w.shutdown) for w in workers))
