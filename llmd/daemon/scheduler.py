"""Admission, queue bounds, cancellation, and routing requests to the loaded engine worker.

State: one ModelState per model name that has been used (its worker when loaded, the requests
holding it, its keep-alive, when it was last used, whether it is retiring); at most `max_loaded`
local workers are kept and the others retire when their last request finishes; one load in flight
per model (concurrent requests share it); the count of admitted requests, bounded by slots +
max_queue. Back-pressure is a typed error (Overloaded -> 503 with Retry-After), never a hang.

It is one module of about 500 lines because loading, the crash-loop breaker, retiring and routing
all read and change the same ModelState records and load tasks; what stands alone lives elsewhere:
the backend choice (backends/select.py), the repack record (backends/repack.py), the worker
process (backends/worker.py), remote models (backends/remote/handle.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from llmd.backends.base import (
    EmbedRequest,
    EmbedResult,
    EngineConfig,
    ErrorEvent,
    Event,
    FinalEvent,
    GenerationRequest,
    Handle,
)
from llmd.backends.llamacpp.context import flash_attention
from llmd.backends.repack import Decision, RepackRecord
from llmd.backends.select import Choice, Probe, choose, formats_of
from llmd.backends.worker import WorkerHandle
from llmd.config import Settings, draft_pairs, fixed_ctx, fixed_threads, parse_duration
from llmd.daemon.residency import draft_copies, why_resident
from llmd.errors import (
    BadRequest,
    ContextGrow,
    ContextOverflow,
    EngineCrashed,
    EngineError,
    ModelUnavailable,
    Overloaded,
    from_wire,
)
from llmd.models.drafts import AUTOMATIC, choose_draft, vocab_compatible
from llmd.models.gguf import GGUFInfo, read_gguf
from llmd.models.memory import (
    AUTO_MIN_CTX,
    ContextChoice,
    DoesNotFit,
    Estimate,
    available_bytes,
    check_fit,
    combined_estimate,
    grow_refusal,
    in_place_refusal,
    load_ctx,
)
from llmd.models.registry import Registry

log = logging.getLogger("llmd.scheduler")

GROW_STEP = 4096  # a context a request asks for (num_ctx) is rounded up to this, so creeping asks reload rarely
# How long a prompt that needs a larger context waits for the model's other requests to finish
# (new ones are held meanwhile); past it the prompt is served within the loaded context instead,
# so an agent's long stream never holds the model's other users for longer.
GROW_WAIT_S = 30.0


def _grow_step(tokens: int) -> int:
    """`tokens` rounded up to a whole GROW_STEP."""
    return -(-tokens // GROW_STEP) * GROW_STEP

CRASH_LIMIT = 3  # worker deaths of one model ...
CRASH_WINDOW_S = 60.0  # ... within this many seconds stop it being started again
STOP_GRACE_S = 5.0  # at the daemon's stop, how long a busy worker gets to finish its call before it is killed

WorkerFactory = Callable[[str, EngineConfig | None, asyncio.AbstractEventLoop, Callable[[WorkerHandle], None]], WorkerHandle]


@dataclass
class Admission:
    """One request's passage from a route into the scheduler, written by both sides.

    Batching hint: a route counts its request in `Scheduler.preparing` as soon as it starts
    (parsing, the response-cache lookup), and `generate` takes it out when it submits
    (`submitted`); a request submitted while others are still being prepared carries
    `more_coming`, so the engine holds its next batch a moment for them (requests that arrive
    together are decoded together). A route that fails before submitting takes it out itself.
    What it cost and who answered: `load_s`, the seconds spent loading the model for it (Ollama's
    load_duration); `fallback`, a remote model's local stand-in answered (its reply is that
    model's: parsed in its chat format, never stored in the response cache)."""

    submitted: bool = False
    load_s: float = 0.0
    fallback: bool = False
    counted: bool = False  # in Scheduler.preparing now

    def enter(self, scheduler: Any) -> None:
        if not self.counted:
            self.counted = True
            scheduler.preparing += 1

    def leave(self, scheduler: Any) -> None:
        """Out of the count, once whoever calls it first (submission, the route, the middleware):
        a request whose stream started before its model had loaded was taken out twice, and the
        count drifted below zero for good."""
        if self.counted:
            self.counted = False
            scheduler.preparing -= 1


@dataclass
class ModelState:
    """What the scheduler knows of one model. It outlives its worker: a request holds the model
    (`users`) from before the load, and a keep-alive set by a request applies to the next load."""

    worker: Handle | None = None
    users: int = 0  # requests using it, from before its load to their end: it is never stopped under them
    keep_alive: float | None = None  # seconds (None: forever); the daemon's until a request sets one
    last_used: float = 0.0  # monotonic
    retiring: bool = False  # stop it once `users` is 0
    ctx_wanted: int = 0  # a context per slot a request asked for (Ollama's num_ctx) above the usual choice
    ctx_refused: int = 0  # the smallest such context memory did not allow (not asked again)
    ctx_why: str = ""  # who asked for ctx_wanted: a request's num_ctx, or a prompt that needed it
    growing: asyncio.Event | None = None  # set while it loads again with a larger context for a prompt
    held: int = 0  # requests waiting for that load (users, but not ones the growth waits for)
    gguf: tuple[Any, Any] = (None, None)  # the loaded model's and draft's GGUFInfo, for grow_refusal


class Scheduler:
    def __init__(self, settings: Settings, registry: Registry, worker_factory: WorkerFactory = WorkerHandle) -> None:
        self.settings = settings
        self.registry = registry
        self._factory = worker_factory
        self.max_loaded = settings.max_loaded
        self.keep_alive = parse_duration(settings.keep_alive)
        self.models: dict[str, ModelState] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._standby: WorkerHandle | None = None  # a started worker waiting for its model
        self.probe: Probe | None = None  # set by the app at start (NVML can take a moment)
        self.version = 0  # bumped on every change a watcher cares about (see /llmd/events)
        self._changed: asyncio.Condition | None = None
        self.choices: dict[str, Choice] = {}
        self._loads: dict[str, asyncio.Task[Handle]] = {}
        self.active_model = settings.model
        self.speculation = settings.speculation  # for requests that name none; the tray can change it
        self._draft_config = draft_pairs(settings.draft)
        self._pairs_checked: dict[tuple[str, str], bool] = {}  # (target, draft) digests -> compatible
        self.in_flight = 0
        self.preparing = 0  # requests the routes are preparing, not yet submitted (see Admission)
        self.capacity = settings.slots + settings.max_queue
        self.started = time.time()
        self.crashes = 0
        self.repack_record = RepackRecord(settings.paths.repack_record)
        self._crash_times: dict[str, deque[float]] = {}  # model -> when its workers died, for the breaker
        self.unavailable: dict[str, str] = {}  # model -> why it is not started again (crash loop)

    @property
    def workers(self) -> dict[str, Handle]:
        """The loaded models' workers, by name."""
        return {n: m.worker for n, m in self.models.items() if m.worker is not None}

    def state(self, name: str) -> ModelState:
        if name not in self.models:
            self.models[name] = ModelState(keep_alive=self.keep_alive)
        return self.models[name]

    def _loaded(self, name: str, worker: Handle) -> None:
        m = self.state(name)
        m.worker, m.last_used, m.retiring = worker, time.monotonic(), False

    @property
    def loading(self) -> list[str]:
        """Models whose load is in flight."""
        return sorted(self._loads)

    # ---- change notification (for /llmd/events) ----------------------------------------------

    def touch(self) -> None:
        self.version += 1
        if self._changed is not None:
            cond = self._changed

            async def _notify() -> None:
                async with cond:
                    cond.notify_all()

            asyncio.ensure_future(_notify())

    async def wait_change(self, seen: int, timeout: float) -> int:
        if self._changed is None:
            self._changed = asyncio.Condition()
        if self.version == seen:
            try:
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.version != seen), timeout)
            except asyncio.TimeoutError:
                pass
        return self.version

    # ---- loading ------------------------------------------------------------------------------

    async def worker_for(self, model: str | None, explicit: bool = False) -> tuple[Handle, float]:
        """The loaded worker of `model` (loading it if needed) and the seconds spent loading.
        A model whose workers keep crashing is not started again unless asked for `explicit`ly
        (`llmd use`, the load route)."""
        name = model or self.active_model
        worker = self.workers.get(name)
        if worker is not None and worker.alive and worker.info:
            return worker, 0.0
        row = self.registry.get(name)  # ModelNotFound before anything starts
        if explicit:
            self.unavailable.pop(name, None)
            self._crash_times.pop(name, None)
        elif name in self.unavailable:
            raise ModelUnavailable(self.unavailable[name])
        t0 = time.perf_counter()
        task = self._loads.get(name)
        if task is None:
            task = asyncio.ensure_future(self._load(name, row))
            self._loads[name] = task
            self.touch()
            task.add_done_callback(self._load_done(name))
        worker = await asyncio.shield(task)
        return worker, time.perf_counter() - t0

    def _grow_for(self, name: str, want: int) -> None:
        """Ollama's num_ctx above the loaded context: load the model again with a larger context per
        slot (rounded up to GROW_STEP, so a client whose num_ctx creeps up reloads rarely), as Ollama
        does, when memory allows it by the one rule the load applies too (memory.grow_refusal) and
        no other request is using the model; otherwise the request is served within the loaded
        context, and the log says why. A context never shrinks for a request that asks for less,
        and one refused is not asked again until memory could have changed (a load)."""
        m = self.state(name)
        want = _grow_step(want)
        if want <= m.ctx_wanted and m.worker is None:
            return
        w = m.worker
        if w is None:  # not loaded yet: the load takes it into account
            if want > m.ctx_wanted:
                m.ctx_wanted, m.ctx_why = want, ""
            return
        if w.remote or w.cfg is None or want <= w.cfg.n_ctx or (m.ctx_refused and want >= m.ctx_refused):
            return
        if want <= w.cfg.ctx_ceiling:  # within what it grows to by use: when a prompt needs it, not now
            return
        loaded = w.cfg.n_ctx
        why = f"{m.users - 1} other requests are using it" if m.users > 1 else self._grow_refusal(m, w, want)
        if why:
            log.warning("a request asks %s for a context of %d tokens (num_ctx) but it is loaded with %d; "
                        "serving it within %d: %s", name, want, loaded, loaded, why)
            if m.users <= 1:
                m.ctx_refused = want
            return
        log.info("loading %s again with a context of %d tokens per slot (was %d): a request asked for it "
                 "(num_ctx)", name, want, loaded)
        m.ctx_wanted, m.ctx_why = want, ""
        self._stop(name)

    async def _grow_for_prompt(self, name: str, needed: int) -> str:
        """A prompt needs `needed` tokens of context and the model, sized by use (memory.starting_ctx),
        may grow: load it again with at least twice its context (so growth is rare), up to its
        ceiling, once the requests it serves have finished (new ones wait for the load), when memory
        allows it by the rule num_ctx follows. "grown" (submit again), or why not and nothing
        changed: "refused" (memory) or "busy" (the others still ran after GROW_WAIT_S)."""
        m = self.state(name)
        if m.growing is not None:  # another prompt's growth is under way: this one is submitted after it
            await self._growth_done(name)
            return "grown"
        w = m.worker
        if w is None or w.cfg is None or not w.cfg.ctx_ceiling:
            return "grown" if m.worker is None else "refused"  # reloaded meanwhile: submit again
        loaded = w.cfg.n_ctx
        want = min(w.cfg.ctx_ceiling, max(_grow_step(needed), 2 * loaded))
        if want <= loaded:
            return "refused"
        why = self._grow_refusal(m, w, want)
        if why:
            log.warning("%s: a prompt needs a context of %d tokens per slot but it is loaded with %d, and %s; "
                        "serving it within %d", name, needed, loaded, why, loaded)
            return "refused"
        m.growing = asyncio.Event()
        try:
            t0 = time.monotonic()
            while m.users - m.held > 1 and m.worker is w:  # the others' streams finish first
                if time.monotonic() - t0 > GROW_WAIT_S:
                    log.warning("%s: a prompt needs a context of %d tokens per slot but it is loaded with %d, "
                                "and %d other requests were still running after %.0f s; serving it within %d",
                                name, needed, loaded, m.users - m.held - 1, GROW_WAIT_S, loaded)
                    return "busy"
                await asyncio.sleep(0.05)
            if m.worker is not w:  # it was unloaded or reloaded meanwhile: the next load chooses again
                return "grown"
            m.ctx_wanted, m.ctx_why = want, f"a prompt needed {needed} (it started at {loaded}; grows by use)"
            if await self._grow_in_place(name, w, want, needed):
                return "grown"
            log.info("loading %s again with a context of %d tokens per slot (was %d): a prompt needed %d",
                     name, want, loaded, needed)
            await self._stop(name)
            return "grown"
        finally:
            m.growing.set()
            m.growing = None

    async def _grow_in_place(self, name: str, w: Handle, want: int, needed: int) -> bool:
        """The worker's context grown to `want` tokens per slot with its weights kept (no reload: a
        few seconds and the in-memory prefix cache saved); False when it did not, and why is logged."""
        if not isinstance(w, WorkerHandle) or w.cfg is None:  # a remote model, or a test's stand-in
            return False
        main, draft = self.state(name).gguf
        if main is not None and (why := in_place_refusal(main, draft, w.cfg.n_slots, want, available_bytes())):
            log.info("%s: its context is not grown in place: %s; loading it again instead", name, why)
            return False
        loaded, t0 = w.cfg.n_ctx, time.perf_counter()
        info = await w.grow(want)
        if not info or "error" in info:
            log.warning("%s: its context did not grow in place (%s); loading it again instead", name,
                        info.get("error") if info else "the worker did not answer")
            return False
        w.cfg = replace(w.cfg, n_ctx=want)
        info.pop("pid", None)
        w.info.update(info)
        w.info["ctx_reason"] = f"{want} tokens per slot: {self.state(name).ctx_why}, grown in place"
        if main is not None:
            flash = flash_attention(self.settings.flash_attn, self.settings.exact, w.cfg.gpu_layers)
            w.info["memory_estimate"] = combined_estimate(main, draft, want, w.cfg.n_slots, flash).as_dict()
        log.info("%s: context grown in place from %d to %d tokens per slot in %.2f s: a prompt needed %d",
                 name, loaded, want, time.perf_counter() - t0, needed)
        return True

    async def _growth_done(self, name: str) -> None:
        """Wait while the model loads again with a larger context (counted in `held`: the growth waits
        for the model's other requests, not for these)."""
        m = self.state(name)
        while (growing := m.growing) is not None:
            m.held += 1
            try:
                await growing.wait()
            finally:
                m.held -= 1

    def _grow_refusal(self, m: ModelState, w: Handle, want: int) -> str | None:
        """memory.grow_refusal for a loaded model: what its reload would free counts as available."""
        info, draft = m.gguf
        est = w.info.get("memory_estimate") or {}
        if info is None or w.cfg is None:
            return None
        gpu_share = (w.info.get("gpu_layers") or 0) / max(1, w.info.get("n_layer") or 1)
        vram, vram_freed = self._vram_available(), int(est.get("kv", 0) * gpu_share)
        return grow_refusal(info, draft, w.cfg.n_slots, want, available_bytes(), est.get("kv", 0),
                            gpu_share, vram, vram_freed)

    def _vram_available(self) -> int | None:
        """Free memory of the GPU llama.cpp offloads to (NVML, read now); None without one."""
        from llmd.backends.select import refresh_gpus

        if self.probe is None or not self.probe.gpus:
            return None
        try:
            gpus = refresh_gpus(self.probe).gpus
        except Exception:  # NVML failing now: nothing to check against
            return None
        return max((g.free_vram for g in gpus), default=None)

    def _load_done(self, name: str) -> Callable[[asyncio.Task[Handle]], None]:
        def done(_task: asyncio.Task[Handle]) -> None:
            self._loads.pop(name, None)

        return done

    async def _load(self, name: str, row: dict[str, Any]) -> Handle:
        s = self.settings
        if row["format"] == "remote":
            return await self._load_remote(name, row)
        choice = self.choice_for(name, row, at_load=True)
        if choice.backend == "none":
            raise EngineError(f"{name} cannot be loaded on this machine: {choice.reason}")
        # refuse before anything is allocated; other loaded models count as used memory already
        draft, draft_why = (await self._draft_for(row) if choice.backend in ("llama.cpp", "tensorrt")
                            else (None, f"not used by {choice.backend}"))
        if choice.backend == "tensorrt" and draft is not None and not draft.get("hf_path"):
            draft_why = (f"{draft['name']} has no Hugging Face folder for TensorRT-LLM (`llmd models add FOLDER "
                         f"--name {draft['name']}` attaches one)")
            draft = None
        # file reads off the event loop
        info = await asyncio.to_thread(read_gguf, row["path"]) if row["format"] == "gguf" else None
        draft_info = (await asyncio.to_thread(read_gguf, draft["path"])
                      if draft and choice.backend == "llama.cpp" else None)
        ctx = self._context(name, info, draft_info)
        gpu_layers = s.gpu_layers if s.gpu_layers >= 0 else choice.gpu_layers
        # the target's attention kernel (its scratch counts); the draft model keeps flash attention
        flash = flash_attention(s.flash_attn, s.exact, gpu_layers) if choice.backend == "llama.cpp" else True
        try:
            estimate = (await self._fit(name, info, ctx.n_ctx, draft_info, flash) if info is not None else None)
        except DoesNotFit:
            if not draft_why.startswith(AUTOMATIC) or info is None:
                raise
            # a draft llmd chose must never stop the model loading: without it, if that fits
            assert draft is not None
            draft_why = f"{draft['name']} (paired automatically) was left out: it and {name} do not fit in memory together"
            draft, draft_info = None, None
            ctx = self._context(name, info, None)
            estimate = await self._fit(name, info, ctx.n_ctx, None, flash)
        model_path = row["hf_path"] if choice.backend == "tensorrt" and row.get("hf_path") else row["path"]
        cfg = EngineConfig(model_path=model_path, model_name=name, n_ctx=ctx.n_ctx, ctx_ceiling=ctx.ceiling,
                           n_slots=s.slots,
                           chunk=s.chunk, threads=fixed_threads(s.threads), gpu_layers=gpu_layers, model_digest=row["digest"],
                           precision=choice.precision,
                           prefix_dir=str(s.paths.prefix_dir), prefix_max_bytes=s.prefix_cache_mb * 1024 * 1024,
                           prefix_key_file=str(s.paths.prefix_key),
                           prefix_min_tokens=s.prefix_min_tokens, profile=s.profile, exact=s.exact,
                           prefill_budget=s.prefill_budget, min_share=s.min_share, prefix_ram_bytes=s.prefix_ram_mb * 1024 * 1024,
                           speculation=s.speculation, flash_attn=s.flash_attn,
                           draft_path=(draft["hf_path"] if choice.backend == "tensorrt" else draft["path"]) if draft
                           else "")
        file_types = tuple(i.quantization for i in (info, draft_info) if i is not None)
        decision = (self.repack_record.decide(s.repack, file_types) if choice.backend == "llama.cpp"
                    else Decision(False, f"not used by {choice.backend}"))
        cfg = replace(cfg, repack=decision.repack)
        try:
            worker = await self._start(cfg, choice.backend)
        except EngineCrashed as e:
            if not (decision.repack and s.repack == "auto" and e.signal):
                raise
            # A kernel of the repacked weights crashed while loading (AMX does): load again without
            # repacking, and remember it for this CPU, llama.cpp build and file type once that works.
            how = f"killed by signal {e.signal}"
            log.warning("weight repacking (%s) crashed on this CPU while loading %s (%s); loading again without it",
                        self.repack_record.kind, name, how)
            worker = await self._start(replace(cfg, repack=False), choice.backend)
            # handled: that crash was the probe of repacking on this CPU, not a worker that keeps
            # dying (counted, two deaths later in the minute would stop the model on every AMX CPU)
            self._crash_times[name].pop()
            entries = [self.repack_record.write_crash(ft, name, how) for ft in file_types]
            decision = Decision(False, entries[0]["reason"], entries[0])
            log.warning("%s (recorded in %s for %s)", decision.reason, self.repack_record.path, "/".join(file_types))
        worker.info["repack"] = decision.as_dict()
        worker.info["memory_estimate"] = estimate.as_dict() if estimate else {}
        worker.info["draft"] = draft["name"] if draft else None
        worker.info["draft_reason"] = draft_why
        worker.info["ctx_reason"] = ctx.reason
        self.state(name).gguf = (info, draft_info)
        self._loaded(name, worker)
        log.info("loaded %s in worker pid %s (%.2fs)", name, worker.pid, worker.info.get("load_s", 0))
        self._retire_idle(keep=name)
        self._ensure_reaper()
        self.touch()
        return worker

    async def _fit(self, name: str, info: GGUFInfo, n_ctx: int, draft: GGUFInfo | None, flash: bool) -> Estimate:
        """check_fit against the memory available now; while it does not fit, the least recently used
        idle model is unloaded to make room (models stay resident by memory, not by count)."""
        while True:
            try:
                return await asyncio.to_thread(check_fit, name, info, n_ctx, self.settings.slots, None, draft, flash)
            except DoesNotFit:
                if not await self._make_room(name):
                    raise

    async def _make_room(self, keep: str) -> bool:
        """Unload the least recently used local model with no open requests, one kept forever
        (keep_alive -1) only after every other, and wait until its memory is back; False when there
        is none. As Ollama does: a pin keeps a model loaded while idle, never another app from loading."""
        idle = sorted((n for n, w in self.workers.items() if n != keep and not w.remote and not self.models[n].users),
                      key=lambda n: (self.models[n].keep_alive is None, self.models[n].last_used))
        if not idle:
            return False
        log.info("unloading %s to make room for %s (least recently used idle model)", idle[0], keep)
        await self._stop(idle[0])
        return True

    def _context(self, name: str, info: GGUFInfo | None, draft: GGUFInfo | None) -> ContextChoice:
        """The context per slot of a load: LLMD_CTX, or the automatic choice, or a larger one a
        request asked for (num_ctx) when its KV cache fits in half the memory available."""
        s = self.settings
        fixed = fixed_ctx(s.ctx)
        if info is None:  # TensorRT reads its engine's own limits; this is what it is built or asked for
            return ContextChoice(fixed or AUTO_MIN_CTX, "set by LLMD_CTX" if fixed else "llmd's default for "
                                 "a checkpoint or engine (set LLMD_CTX)")
        ctx = load_ctx(info, s.slots, fixed, s.ctx_start, None, draft)
        m = self.state(name)
        wanted, m.ctx_refused = m.ctx_wanted, 0  # a load asks memory again
        # a num_ctx within the ceiling is served by use (Cline sends 32768 with every request): only a
        # prompt that needed more, or a num_ctx beyond the ceiling, loads a larger context up front
        if wanted > ctx.n_ctx and (m.ctx_why or wanted > ctx.ceiling):
            why = grow_refusal(info, draft, s.slots, wanted, available_bytes())  # nothing of it is loaded now
            if why is None:
                beyond = (f"; beyond the {info.context_length} tokens the model was trained for"
                          if info.context_length and wanted > info.context_length else "")
                asked = m.ctx_why or f"a request asked for {wanted} (num_ctx)"
                return ContextChoice(wanted, f"{wanted} tokens per slot: {asked}{beyond}",
                                     ceiling=max(ctx.ceiling, wanted) if ctx.ceiling else 0)
            log.warning("%s: a request asked for a context of %d tokens (num_ctx) but %s; loading with %d",
                        name, wanted, why, ctx.n_ctx)
            m.ctx_refused = wanted
        return ctx

    async def _load_remote(self, name: str, row: dict[str, Any]) -> Handle:
        """A remote model: no process, a handle that relays to its upstreams (checked once here)."""
        from llmd.backends.remote.handle import RemoteHandle, RemoteSpec

        spec = RemoteSpec.from_json(row["remote"])
        cfg = EngineConfig(model_path=spec.urls[0], model_name=name, n_ctx=fixed_ctx(self.settings.ctx), n_slots=0, chunk=0,
                           model_digest=row["digest"])
        handle = await RemoteHandle(spec, cfg, asyncio.get_running_loop(), self.settings.remote_read_s,
                                    self.settings.remote_first_token_s).start()
        self._loaded(name, handle)
        self._ensure_reaper()
        self.touch()
        return handle

    async def _start(self, cfg: EngineConfig, backend: str) -> WorkerHandle:
        """A worker with the model loaded; a crash while loading counts toward the breaker and is
        raised as EngineCrashed with .signal set when a signal killed it."""
        worker = await self._take_standby(cfg, backend)
        try:
            try:
                await asyncio.wait_for(worker.wait_loaded(), self.settings.load_timeout_s)
            except asyncio.TimeoutError:
                why = (f"loading {cfg.model_name} took over {self.settings.load_timeout_s:g} s (LLMD_LOAD_TIMEOUT_S) "
                       "and was stopped; check the model file and the machine's load, then `llmd use "
                       f"{cfg.model_name}` to try again")
                log.error("%s", why)
                worker.process.kill()  # it would not read a Shutdown while stuck in its load
                self.unavailable[cfg.model_name] = why
                raise ModelUnavailable(why) from None
        except EngineCrashed as e:
            await asyncio.to_thread(worker.shutdown)
            code = worker.process.exitcode
            e.signal = -code if code is not None and code < 0 else 0
            self._note_crash(cfg.model_name, e.message)
            if cfg.model_name in self.unavailable:
                raise ModelUnavailable(self.unavailable[cfg.model_name]) from e
            raise
        except BaseException:
            await asyncio.to_thread(worker.shutdown)
            raise
        return worker

    def _note_crash(self, name: str, what: str) -> None:
        """Count a worker's death; the third within a minute stops the model being started again
        until it is asked for explicitly or the daemon restarts (no crash loop)."""
        now = time.monotonic()
        times = self._crash_times.setdefault(name, deque(maxlen=CRASH_LIMIT))
        times.append(now)
        if len(times) == CRASH_LIMIT and now - times[0] <= CRASH_WINDOW_S:
            self.unavailable[name] = (
                f"{name} is not started again: its engine worker crashed {CRASH_LIMIT} times within "
                f"{CRASH_WINDOW_S:.0f} s (last: {what}). Fix the cause (`llmd doctor`, the log; LLMD_REPACK=off "
                f"if weight repacking crashes), then run `llmd use {name}` or restart the daemon"
            )
            log.error("%s", self.unavailable[name])
            self.touch()

    async def _draft_for(self, row: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """The model's draft model and why (models/drafts.py), vocabularies read off the event loop."""
        return await asyncio.to_thread(choose_draft, row, self.registry.list(), self._draft_config.get(row["name"]),
                                       self.settings.auto_draft, self._compatible)

    def _compatible(self, row: dict[str, Any], draft: dict[str, Any]) -> bool:
        """Whether `draft` can draft for `row`, compared once per pair of files."""
        key = (row["digest"], draft["digest"])
        if key not in self._pairs_checked:
            self._pairs_checked[key] = vocab_compatible(row, draft)
        return self._pairs_checked[key]

    def choice_for(self, name: str, row: dict[str, Any] | None = None, at_load: bool = False) -> Choice:
        """The backend for a model on this machine (probed once), with its reasons. `at_load`: the
        GPUs' free memory is read again first (other models, llmd's or another program's, may hold
        some now), so the layers put on a GPU are those that fit at this load."""
        if at_load and self.probe is not None and self.probe.gpus:
            from llmd.backends.select import refresh_gpus

            self.probe = refresh_gpus(self.probe)
            self.choices.pop(name, None)
        if name not in self.choices:
            row = row or self.registry.get(name)
            if row["format"] == "remote":
                urls = ", ".join(json.loads(row["remote"])["urls"])
                return Choice("remote", "upstream", reasons=(f"served by its upstream engines ({urls})",))
            if self.probe is None:
                from llmd.backends.select import probe

                self.probe = probe()
            row = row or self.registry.get(name)
            override = None if self.settings.backend == "auto" else self.settings.backend
            self.choices[name] = choose(self.probe, formats_of(row, fixed_ctx(self.settings.ctx), self.settings.slots),
                                        override)
            log.info("backend for %s: %s %s (%s)", name, self.choices[name].backend, self.choices[name].precision,
                     self.choices[name].reason)
        return self.choices[name]

    async def _take_standby(self, cfg: EngineConfig, backend: str) -> WorkerHandle:
        """The standby worker (interpreter and llama_cpp already loaded) if there is one, else a new
        worker; then start the next standby so the following switch is fast too. Process spawns
        run in a thread: the event loop keeps serving while they start."""
        loop = asyncio.get_running_loop()
        worker = self._standby
        self._standby = None
        if worker is not None and worker.alive and worker.backend == backend:
            worker.assign(cfg)
        else:
            if worker is not None:
                loop.run_in_executor(None, worker.shutdown)
            worker = await asyncio.to_thread(self._factory, backend, cfg, loop, self._on_exit)
        if self.settings.standby:
            standby = await asyncio.to_thread(self._factory, backend, None, loop, self._on_exit)
            if self._standby is None:
                self._standby = standby
            else:  # another load made one meanwhile
                loop.run_in_executor(None, standby.shutdown)
        return worker

    def _on_exit(self, worker: WorkerHandle) -> None:
        if worker.cfg is None:
            if self._standby is worker:
                self._standby = None
            return
        name = worker.cfg.model_name
        if self.workers.get(name) is worker:
            self.state(name).worker = None
            code = worker.process.exitcode
            if code not in (0, None):
                self.crashes += 1
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                self._note_crash(name, f"the worker was {how} while serving")
            self.touch()

    def _retire_idle(self, keep: str | None = None) -> None:
        """Stop workers beyond max_loaded (least recently used first), and those asked to unload,
        once they have no open requests: a stream in flight always finishes."""
        keep = keep or self.active_model
        workers = self.workers
        local = [n for n, w in workers.items() if not w.remote]  # remote ones hold no memory
        extra = sorted((n for n in local if n != keep), key=lambda n: self.models[n].last_used)
        over = len(local) - self.max_loaded if self.max_loaded else 0  # 0: by memory (_make_room)
        for name in extra:
            if over > 0:
                self.models[name].retiring = True
                over -= 1
        for name, m in self.models.items():
            if m.retiring and m.worker is None:
                m.retiring = False
            elif m.retiring and not m.users:
                self._stop(name)

    def _stop(self, name: str) -> asyncio.Future[None]:
        """Unload `name`: its worker shuts down in a thread; the future is done when it has exited."""
        m = self.models[name]
        worker, m.worker, m.retiring, m.keep_alive = m.worker, None, False, self.keep_alive
        assert worker is not None
        log.info("unloading %s (worker pid %s)", name, worker.pid)
        self.touch()
        return asyncio.get_running_loop().run_in_executor(None, worker.shutdown)

    def unload(self, name: str) -> bool:
        """Unload now, or as soon as its open requests finish. False if it was not loaded."""
        if name not in self.workers:
            return False
        self.models[name].retiring = True
        self._retire_idle()
        return True

    async def set_active(self, name: str) -> Handle:
        """Make `name` the model for requests that name none; load it, retire the others."""
        self.registry.get(name)
        worker, _ = await self.worker_for(name, explicit=True)
        self.active_model = name
        self._retire_idle(keep=name)
        self.touch()
        return worker

    def set_keep_alive(self, name: str, value: str | float | int | None) -> None:
        """Ollama's per-request keep_alive: applies to the model from now on; 0 unloads after the request."""
        try:
            self.state(name).keep_alive = parse_duration(value)
        except ValueError as e:
            raise BadRequest(str(e), "keep_alive") from None

    def reprioritize(self, name: str, request_id: str, priority: str) -> None:
        """Another class for a request of a loaded model (nothing when it has ended or the model is gone)."""
        worker = self.workers.get(name)
        if worker is not None:
            worker.reprioritize(request_id, priority)

    def keep_alive_for(self, name: str) -> float | None:
        return self.state(name).keep_alive

    def why_resident(self, name: str, short: bool = False) -> str:
        """Why `name` is still loaded (residency.why_resident): its requests, or its keep-alive."""
        m = self.state(name)
        now = time.monotonic()
        return why_resident(m.users, m.keep_alive, now - (m.last_used or now), short)

    def expires_at(self, name: str) -> float | None:
        keep = self.keep_alive_for(name)
        if keep is None:
            return None
        return time.time() + keep - (time.monotonic() - (self.state(name).last_used or time.monotonic()))

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        """Unload models idle longer than their keep_alive; stop workers that hang."""
        while self.workers:
            now = time.monotonic()
            wait = 1.0
            for name, worker in list(self.workers.items()):
                silent = worker.silent_for()
                if silent > self.settings.hang_s and worker.hung_for is None:
                    worker.kill_hung(silent)
                    continue
                keep = self.keep_alive_for(name)
                m = self.models[name]
                if keep is None or m.users:
                    continue
                left = m.last_used + keep - now
                if left <= 0:
                    self._stop(name)
                else:
                    wait = min(wait, left)
            await asyncio.sleep(max(wait, 0.05))

    # ---- generation ---------------------------------------------------------------------------

    async def generate(self, model: str | None, req: GenerationRequest | EmbedRequest,
                       admission: Admission | None = None) -> AsyncIterator[Event]:
        """Events of one request, ending with a FinalEvent (an EmbedResult for embeddings); an
        ErrorEvent is raised as its LlmdError. Closing the iterator early (client gone) cancels
        the request in the engine."""
        if self.in_flight >= self.capacity:
            raise Overloaded(
                f"{self.in_flight} requests are running or queued (limit {self.capacity}: "
                f"{self.settings.slots} slots + {self.settings.max_queue} queued); retry shortly",
                retry_after=1,
            )
        name = model or self.active_model
        held = self.state(name).users
        if held >= self.settings.max_queue_model:
            raise Overloaded(
                f"{held} requests are running or waiting for {name} (limit {self.settings.max_queue_model} per model, "
                f"LLMD_MAX_QUEUE_MODEL){' while it loads' if name in self._loads else ''}; retry shortly",
                retry_after=1,
            )
        self.in_flight += 1
        self.touch()
        self.state(name).users += 1
        users = [name]  # models this request holds loaded (a remote model's fallback too)
        try:
            if isinstance(req, GenerationRequest) and req.ctx_limit:
                self._grow_for(name, req.ctx_limit)
            await self._growth_done(name)  # held back while the model loads again for a longer prompt
            worker, load_s = await self.worker_for(name)
            if admission is not None:
                admission.load_s = load_s
            if admission is not None and not admission.submitted:  # counted in `preparing` by the route
                admission.submitted = True
                admission.leave(self)
                if self.preparing > 0 and isinstance(req, GenerationRequest):
                    req = replace(req, more_coming=True)
            queue = worker.submit(req)
            finished = False
            fallback = worker.fallback  # a remote model's local stand-in
            started, busy_growth = False, 0
            try:
                while True:
                    ev = await queue.get()
                    if isinstance(ev, ErrorEvent):
                        finished = True
                        err = from_wire(ev.error)
                        if isinstance(err, ContextGrow) and isinstance(req, GenerationRequest) and not started:
                            # the prompt needs a larger context than the model was loaded with
                            worker.forget(req.id)
                            grew = await self._grow_for_prompt(name, err.needed)
                            if grew != "grown":
                                req = replace(req, no_grow=True)
                                busy_growth = err.needed if grew == "busy" else 0
                            worker, _ = await self.worker_for(name)
                            queue, finished = worker.submit(req), False
                            continue
                        if busy_growth and isinstance(err, ContextOverflow):
                            raise Overloaded(
                                f"this prompt needs {busy_growth} tokens of context and {name} grows to hold it once "
                                f"its other requests finish, but they were still running after {GROW_WAIT_S:.0f} s "
                                "(the prompt does not fit the context loaded now); retry shortly",
                                retry_after=5) from err
                        if fallback and not started and isinstance(err, ModelUnavailable) and fallback != name:
                            # every upstream is down: the local model configured for it answers
                            log.warning("%s: %s; answering with the fallback %s", name, err.message, fallback)
                            self.state(fallback).users += 1
                            users.append(fallback)
                            worker, _ = await self.worker_for(fallback)
                            if admission is not None:
                                admission.fallback = True
                            queue, finished, fallback = worker.submit(req), False, None
                            continue
                        raise err
                    started = True
                    yield ev
                    if isinstance(ev, FinalEvent | EmbedResult):
                        finished = True
                        return
            finally:
                if finished:
                    worker.forget(req.id)
                else:
                    worker.cancel(req.id)
        finally:
            if admission is not None:  # cancelled or failed before submission
                admission.leave(self)
            self.in_flight -= 1
            self.touch()
            for used in users:
                self.models[used].users -= 1
                self.models[used].last_used = time.monotonic()
            if self.keep_alive_for(name) == 0 and name in self.workers:
                self.models[name].retiring = True  # keep_alive 0: unload as soon as the request is done
            self._retire_idle()

    # ---- status and shutdown ------------------------------------------------------------------

    async def embed(self, model: str, req: EmbedRequest) -> EmbedResult:
        events = self.generate(model, req)
        try:
            async for ev in events:
                if isinstance(ev, EmbedResult):
                    return ev
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        raise EngineCrashed(f"the worker for {model} answered no embedding; retry the request")

    async def status(self) -> dict[str, Any]:
        loaded = []
        for name, w in list(self.workers.items()):
            stats = await w.stats()
            loaded.append({"name": name, "pid": w.pid, "since": w.started, "open_requests": w.open_requests,
                           "expires_at": self.expires_at(name), "retiring": self.models[name].retiring,
                           "resident": self.why_resident(name),
                           **{k: v for k, v in w.info.items() if k not in ("pid",)}, "stats": stats})
        for entry in loaded:
            entry["draft_copies"] = draft_copies(entry["name"], loaded)
        return {
            "active_model": self.active_model,
            "speculation": self.speculation,
            "loaded": loaded,
            "loading": self.loading,
            "requests_in_flight": self.in_flight,
            "capacity": self.capacity,
            "worker_crashes": self.crashes,
            "unavailable": dict(self.unavailable),
            "repack": {"mode": self.settings.repack, "kind": self.repack_record.kind,
                       "records": self.repack_record.here()},
        }

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._loads.values()):
            task.cancel()
        workers = list(self.workers.values())
        for m in self.models.values():
            m.worker = None
        if self._standby is not None:
            workers.append(self._standby)
            self._standby = None
        # the daemon is stopping: a worker inside a long call (a batch of embeddings reads no message
        # until it ends) is not waited for past STOP_GRACE_S; its requests were answered 503 already
        await asyncio.gather(*(asyncio.to_thread(w.shutdown, STOP_GRACE_S) for w in workers))
