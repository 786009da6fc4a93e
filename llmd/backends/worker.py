"""Engine worker process and the daemon's handle on it.

Each loaded model runs in its own process (multiprocessing, spawn) so that a crash in the
engine (a bad GGUF, a CUDA error, kill -9) takes down only that worker. The daemon talks to
it over one Pipe: commands go down (GenerationRequest, EmbedRequest, Cancel, StatsRequest, ClearCaches, Shutdown); a list
of events per engine step comes back. A reader thread in the daemon hands events to the
asyncio queue of their request; at EOF every request still open gets an EngineCrashed error.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue as queue_mod
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from llmd.backends.base import (
    Cancel,
    ClearCaches,
    Cleared,
    EmbedRequest,
    EngineConfig,
    ErrorEvent,
    Event,
    GenerationRequest,
    Grow,
    Grown,
    Loaded,
    Reprioritize,
    Shutdown,
    Stats,
    StatsRequest,
)
from llmd.backends.cpu_board import Claim, CpuBoard, Turns, turn_share
from llmd.backends.cpu_board import board as cpu_board
from llmd.errors import EngineCrashed, EngineError, LlmdError, ModelUnavailable, from_wire
from llmd.logs import daemon_log_file, worker_setup
from llmd.priority import CLASSES, class_index

log = logging.getLogger("llmd.worker")
_GONE = object()  # put in a handle's outbox once its worker has exited: the writer thread ends


def engine_class(backend: str) -> Any:
    """Import an engine class by name only when it is needed (heavy imports stay lazy)."""
    from llmd.backends import ENGINES

    module_name, _, cls_name = ENGINES[backend].partition(":")
    module = __import__(module_name, fromlist=[cls_name])
    return getattr(module, cls_name)


COALESCE_S = 0.03  # the longest a first batch waits for requests that arrived with it
# after a step given up for a newcomer (the engine's JOIN_S): the daemon flags a request before its
# writer thread has sent it, so the worker waits this long for it rather than step without it
YIELD_WAIT_S = 0.01


def worker_main(conn: Any, backend: str, cfg: EngineConfig | None, sent: Any = None,
                board: CpuBoard | None = None, row: int | None = None, sent_by_class: Any = None,
                log_file: str | None = None) -> None:
    """Entry point of the worker process. With cfg None it is a standby: it imports the engine
    (llama_cpp and its shared library) now and waits for the EngineConfig of the next load, so a
    model switch does not pay for interpreter start and imports. `sent` counts the requests the daemon
    has handed over (shared memory, raised before each is written to the pipe). `board` and `row`:
    the CPU board this worker shares with the other models' (cpu_board.py). `sent_by_class`: the
    generation requests handed over per llmd.priority class, so a prompt step can be given up for a
    more urgent one before it is read. `log_file`: the daemon's JSON log, which the worker's own
    lines go to as well."""
    worker_setup(log_file)
    try:
        cls = engine_class(backend)
        if cfg is None:
            preload = getattr(cls, "preload", None)
            if preload is not None:
                preload()
            try:
                cfg = conn.recv()
            except (EOFError, KeyboardInterrupt):
                return
            if not isinstance(cfg, EngineConfig):
                return
        engine = cls(cfg)
    except LlmdError as e:
        conn.send(Loaded({}, e.to_wire()))
        return
    except Exception as e:
        name = cfg.model_name if cfg else "a model"
        conn.send(Loaded({}, EngineError(f"{backend} could not load {name}: {e}").to_wire()))
        return
    conn.send(Loaded(engine.info()))
    last_sent = time.monotonic()
    received = 0  # requests read from the pipe
    received_by_class = [0] * len(CLASSES)  # generation requests read, per class (sent_by_class)

    def pending() -> bool:
        """A request is on its way that this worker has not read yet: idle work yields to it at
        once, and a burst's first step to a newcomer. Not the request the step is for: a flag
        raised with each request and cleared before each read aborted every lone request's first
        step for one that had already arrived (13-38 ms of its first token on the 1.5B)."""
        return sent.value > received

    def urgent(rank: int) -> bool:
        """A generation request of a class ranked above `rank` is on its way (llmd.priority)."""
        return any(sent_by_class[c] > received_by_class[c] for c in range(min(rank, len(CLASSES))))

    if sent is not None:
        engine.interrupt = pending
    if sent_by_class is not None and hasattr(engine, "urgent"):
        engine.urgent = urgent

    def heartbeat() -> None:  # inside a long call (a prompt step, embeddings): busy, not hung
        nonlocal last_sent
        if time.monotonic() - last_sent > HEARTBEAT_S:
            conn.send([])
            last_sent = time.monotonic()

    if hasattr(engine, "heartbeat"):
        engine.heartbeat = heartbeat
    turn = (BoardTurn(board, row, engine, cfg.min_share) if board is not None and row is not None else None)
    try:
        while True:
            idle = not engine.has_work()
            timeout = None if idle else (YIELD_WAIT_S if getattr(engine, "yielded", False) else 0.0)
            paused = turn is not None and turn.paused(idle)
            if paused:
                timeout = PAUSED_POLL_S
            hold_until = 0.0
            while conn.poll(timeout):
                msg = conn.recv()
                timeout = 0.0
                if isinstance(msg, GenerationRequest | EmbedRequest):
                    received += 1
                if isinstance(msg, GenerationRequest):
                    received_by_class[class_index(msg.priority)] += 1
                    engine.submit(msg)
                    if idle and msg.more_coming:
                        # Requests that arrived together reach us one by one (the daemon competes with
                        # the engine for the cores): hold the first batch briefly so they share it
                        # instead of waiting for a whole prefill each. A lone request never waits.
                        hold_until = hold_until or time.monotonic() + COALESCE_S
                        timeout = max(0.0, hold_until - time.monotonic())
                elif isinstance(msg, EmbedRequest):
                    # between steps: a batch of embeddings pauses generation for its one decode each
                    if turn is not None:  # in its class's turn (background unless asked): after more urgent work
                        if hasattr(engine, "embed_turn"):  # input by input
                            engine.embed_turn = EmbedTurn(turn, heartbeat, msg.priority)
                        else:
                            turn.wait(Claim(msg.priority, False, time.perf_counter()), heartbeat)
                    try:
                        conn.send([engine.embed(msg)])
                    except LlmdError as e:
                        conn.send([ErrorEvent(msg.id, e.to_wire())])
                    except Exception as e:  # a bug or a llama.cpp failure: this request fails, the worker serves on
                        log.exception("embedding request %s failed", msg.id)
                        conn.send([ErrorEvent(msg.id, EngineError(f"the engine failed to embed: {e}").to_wire())])
                    finally:
                        if turn is not None:  # the batch is done: its claim leaves the board
                            turn.done()
                elif isinstance(msg, Cancel):
                    engine.cancel(msg.id)
                elif isinstance(msg, Reprioritize):
                    if hasattr(engine, "reprioritize"):
                        engine.reprioritize(msg.id, msg.priority)
                elif isinstance(msg, StatsRequest):
                    conn.send(Stats(engine.stats()))
                elif isinstance(msg, ClearCaches):
                    conn.send(Cleared(engine.clear_caches()))
                elif isinstance(msg, Grow):
                    conn.send(Grown(_grow(engine, msg.n_ctx)))
                elif isinstance(msg, Shutdown):
                    return
            if sent_by_class is not None and sent.value == received:
                # all read: the counts agree (a request whose class changed before it was pickled
                # must not leave a phantom urgent one that gives up every later prompt step)
                received_by_class[:] = sent_by_class[:]
            if turn is not None:  # again with what just arrived: a newcomer may have to wait, or outrank
                paused = turn.paused(not engine.has_work())
            if paused:
                heartbeat()  # requests open, no step: still answering
                continue
            events = engine.step()
            if events or (not idle and time.monotonic() - last_sent > HEARTBEAT_S):
                # an empty list is the heartbeat: busy without events (a long prefill) is not hung
                with engine.profiler.span("ipc"):
                    conn.send(events)
                last_sent = time.monotonic()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    finally:
        if turn is not None:
            turn.done()
        engine.close()


def _grow(engine: Any, n_ctx: int) -> dict[str, Any]:
    """The engine's context grown in place (its info after), or {"error": why} when it cannot."""
    grow = getattr(engine, "grow", None)
    if grow is None:
        return {"error": f"the {getattr(engine, 'name', 'engine')} engine does not grow its context in place"}
    try:
        return dict(grow(n_ctx))
    except LlmdError as e:
        return {"error": e.message}
    except Exception as e:  # a llama.cpp failure: the daemon loads the model again instead
        log.exception("growing the context in place failed")
        return {"error": f"{type(e).__name__}: {e}"}


PAUSED_POLL_S = 0.005  # a paused worker looks at the board again this often (and at its pipe)


class BoardTurn:
    """A worker's use of the CPU board: publish what it holds, learn whether to step and on how many
    threads, and take its turns while held back (cpu_board.Turns). Engines without `claim`
    (TensorRT-LLM: its GPU is not the shared CPU) never pause."""

    def __init__(self, board: CpuBoard, row: int, engine: Any, min_share: float = 0.0) -> None:
        self.board, self.row, self.engine = board, row, engine
        self._claim = getattr(engine, "claim", None)
        gov = getattr(engine, "governor", None)
        self.most = gov.most if gov is not None else 1
        self._mine: Claim | None = None
        self.turns = Turns(min_share)
        if self._claim is not None:
            engine.outranked = self.outranked
            engine.board_turns = self.turns

    def outranked(self) -> bool:
        """Inside a step: keep this worker's row fresh, and say whether another model's work ranks
        above it (never during its turn: the claim it published says so); the step is then held
        (step_watch.py), which counts as being held back (Turns.last_held: short steps follow)."""
        self.board.publish(self.row, self._mine)
        above = self.board.verdict(self.row, self._mine, self.most).pause
        if above:
            self.turns.last_held = time.perf_counter()
        return above

    def paused(self, idle: bool) -> bool:
        """Publish this worker's claim; True when it should not step now."""
        if self._claim is None:
            return False
        now = time.perf_counter()
        if idle:
            self.board.clear(self.row)
            self.turns.due(False, now)
            return False
        mine = self._mine = self._claim()
        self.board.publish(self.row, mine)
        v = self.board.verdict(self.row, mine, self.most)
        turn = self.turns.due(v.pause and mine is not None, now, self.board.turn_taken(self.row, now),
                              turn_share(mine.cls) if mine is not None else 1.0)
        if turn and mine is not None:
            mine = self._mine = replace(mine, turn=True)
            self.board.publish(self.row, mine)
            v = self.board.verdict(self.row, mine, self.most)
        self.engine.board_rows = self.turns.step_rows(now)
        self.engine.share = v.share if v.others else None
        self.engine.share_reason = v.why
        return v.pause

    def wait(self, mine: Claim, heartbeat: Callable[[], None]) -> None:
        """Hold `mine` (work done in one call, such as an embedding batch's input) until it may run,
        or its turn comes; the claim stays on the board while that work runs (`done` clears it)."""
        self.board.publish(self.row, mine)
        while self.board.verdict(self.row, mine, self.most).pause:
            now = time.perf_counter()
            if self.turns.due(True, now, self.board.turn_taken(self.row, now), turn_share(mine.cls)):
                self.board.publish(self.row, replace(mine, turn=True))
                return
            heartbeat()
            self.board.publish(self.row, mine)  # keep the row fresh while it waits
            time.sleep(PAUSED_POLL_S)
        self.turns.due(False, time.perf_counter())

    def done(self) -> None:
        self.board.clear(self.row)


class EmbedTurn:
    """Before each input of an embedding batch: wait for the board. The batch ages (priority) from
    its arrival until its first input runs, then from the last input done, as a generation does."""

    def __init__(self, turn: BoardTurn, heartbeat: Callable[[], None], priority: str = "background") -> None:
        self.turn, self.heartbeat, self.priority = turn, heartbeat, priority
        self.since = time.perf_counter()
        self.first = True

    def __call__(self) -> None:
        if not self.first:
            self.since = time.perf_counter()  # the previous input is done
        self.first = False
        self.turn.wait(Claim(self.priority, False, self.since), self.heartbeat)


# A busy worker sends at least this often, events or not. Well under any LLMD_HANG_S a person would
# set (tests use 6): at 5 s, one slow graph operation on a loaded machine left a 6 s gap in CI.
HEARTBEAT_S = 1.0


class WorkerHandle:
    """The daemon side of one worker process (a backends.base.Handle). Thread-safe sends; events
    land on asyncio queues."""

    remote = False
    fallback: str | None = None

    def __init__(self, backend: str, cfg: EngineConfig | None, loop: asyncio.AbstractEventLoop,
                 on_exit: Callable[[WorkerHandle], None] | None = None) -> None:
        self.backend = backend
        self.cfg = cfg
        self.loop = loop
        self.info: dict[str, Any] = {}
        self.started = time.time()
        self._on_exit = on_exit
        self._queues: dict[str, asyncio.Queue[Event]] = {}
        self._lock = threading.Lock()
        self._loaded: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._asked: dict[type, asyncio.Future[dict[str, Any]]] = {}  # StatsRequest, ClearCaches
        self._last_stats: tuple[float, dict[str, Any]] | None = None  # (monotonic time, answer)
        self.alive = True
        self.last_heard = time.monotonic()  # any message from the worker (events, heartbeat, stats)
        self._busy_since = time.monotonic()  # when the worker last got a request while it had none open
        self.hung_for: float | None = None  # set when the daemon stopped it for not answering
        self.stopping = False  # told to shut down: requests it still holds were cut, not crashed
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._sent = ctx.RawValue("Q", 0)  # requests handed to the writer (only submit writes it)
        self._sent_by_class = ctx.RawArray("Q", len(CLASSES))  # generation requests of those, per class
        label = cfg.model_name if cfg else "standby"
        self._board = cpu_board()
        self._row = self._board.take()
        self.process = ctx.Process(target=worker_main, args=(child, backend, cfg, self._sent, self._board, self._row,
                                                                     self._sent_by_class, daemon_log_file()),
                                   daemon=True, name=f"llmd-worker-{label}")
        self.process.start()
        child.close()
        self._reader = threading.Thread(target=self._read, name=f"llmd-reader-{label}", daemon=True)
        self._reader.start()
        # Pipe writes block while the worker is inside a step and its pipe buffer (64 KiB) is full: a
        # few-MB prompt held every route for over a second when sent from the event loop. One writer
        # thread per worker sends, in order, so nothing on the loop ever waits on the pipe.
        self._outbox: queue_mod.SimpleQueue[Any] = queue_mod.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name=f"llmd-writer-{label}", daemon=True)
        self._writer.start()

    def silent_for(self) -> float:
        """Seconds since the worker last sent anything, while it has requests open (else 0), counted
        from the first open request at the earliest: an idle worker owes no messages."""
        if not self.alive or not self._queues or not self._loaded.done():
            return 0.0
        return time.monotonic() - max(self.last_heard, self._busy_since)

    def kill_hung(self, silent: float) -> None:
        """Stop a worker that sends nothing while it has work: its requests get an error that says so
        (through the usual exit path) and the next request starts a new worker."""
        self.hung_for = silent
        log.error("worker for %s (pid %s) sent nothing for %.0f s with %d requests open; stopping it",
                  self.label, self.pid, silent, len(self._queues))
        self.process.kill()

    def assign(self, cfg: EngineConfig) -> None:
        """Give a standby worker the model to load."""
        assert self.cfg is None, "only a standby worker takes a model"
        self.cfg = cfg
        self._outbox.put(cfg)

    @property
    def label(self) -> str:
        return self.cfg.model_name if self.cfg else "standby"

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def open_requests(self) -> int:
        return len(self._queues)

    async def wait_loaded(self) -> dict[str, Any]:
        return await asyncio.shield(self._loaded)

    def submit(self, req: GenerationRequest | EmbedRequest) -> asyncio.Queue[Event]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        with self._lock:
            if not self.alive:
                raise EngineCrashed(f"the worker for {self.label} has exited; retry the request")
            if not self._queues:
                self._busy_since = time.monotonic()
            self._queues[req.id] = queue
            self._sent.value += 1  # idle work in the worker yields now, before the request is even read
            if isinstance(req, GenerationRequest):  # and a less urgent prompt's step
                self._sent_by_class[class_index(req.priority)] += 1
            self._outbox.put(req)
        return queue

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self._queues.pop(request_id, None) is not None and self.alive:
                self._outbox.put(Cancel(request_id))

    def reprioritize(self, request_id: str, priority: str) -> None:
        with self._lock:
            if request_id in self._queues and self.alive:
                self._outbox.put(Reprioritize(request_id, priority))

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    async def stats(self, timeout: float = 2.0) -> dict[str, Any]:
        """The engine's figures; when it is too slow to answer (a long step on a busy machine), the
        last ones it gave, with `stale_s` saying how old they are, rather than nothing."""
        info = await self._ask(StatsRequest(), timeout)
        if info:
            self._last_stats = (time.monotonic(), info)
            return info
        if self._last_stats is None or not self.alive:
            return {}
        at, last = self._last_stats
        return {**last, "stale_s": round(time.monotonic() - at, 1)}

    async def clear_caches(self, timeout: float = 60.0) -> dict[str, Any]:
        """The engine drops its caches (between steps, in the worker); {} if it is gone or too slow."""
        return await self._ask(ClearCaches(), timeout)

    async def grow(self, n_ctx: int, timeout: float = 300.0) -> dict[str, Any]:
        """The engine's context made `n_ctx` tokens per slot in place (Grow): its info after, or
        {"error": why}; {} when the worker is gone or too slow."""
        return await self._ask(Grow(n_ctx), timeout)

    async def _ask(self, message: StatsRequest | ClearCaches | Grow, timeout: float) -> dict[str, Any]:
        """Send a command the worker answers with a dict (one of each kind in flight: callers share
        it) and wait for the answer; {} when the worker is gone, not loaded, or too slow."""
        if not self.alive or not self._loaded.done():
            return {}
        command = type(message)
        fut = self._asked.get(command)
        if fut is None or fut.done():
            fut = self._asked[command] = self.loop.create_future()
            self._outbox.put(message)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return {}

    def _answered(self, command: type[StatsRequest | ClearCaches | Grow], info: dict[str, Any]) -> None:
        fut = self._asked.get(command)
        if fut is not None and not fut.done():
            fut.set_result(info)

    def shutdown(self, timeout: float = 30.0) -> None:
        self.stopping = True
        if self.alive:
            self._outbox.put(Shutdown())
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)

    def _write(self) -> None:
        """The writer thread: everything for the worker goes down the pipe from here, in order. It
        ends when the worker has been told to shut down, or has exited (the reader's _GONE)."""
        while True:
            msg = self._outbox.get()
            if msg is _GONE:
                return
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the worker is gone: the reader thread reports its exit
                return
            except Exception as e:  # a message that cannot be sent (not picklable): fail it, send on
                log.exception("could not send %s to the worker for %s", type(msg).__name__, self.label)
                rid = getattr(msg, "id", None)
                if isinstance(msg, GenerationRequest | EmbedRequest):
                    with self._lock:
                        self._sent.value -= 1  # never arrives: the worker must not wait for it
                        if isinstance(msg, GenerationRequest):
                            self._sent_by_class[class_index(msg.priority)] -= 1
                if isinstance(rid, str):
                    err = EngineError(f"llmd could not hand the request to the engine worker ({type(e).__name__}: {e})")
                    failed: list[Event] = [ErrorEvent(rid, err.to_wire())]
                    self.loop.call_soon_threadsafe(self._dispatch, failed)
                continue
            if isinstance(msg, Shutdown):
                return

    # ---- reader thread ------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                self.last_heard = time.monotonic()
                if isinstance(msg, list):
                    self.loop.call_soon_threadsafe(self._dispatch, msg)
                elif isinstance(msg, Loaded):
                    self.loop.call_soon_threadsafe(self._set_loaded, msg)
                elif isinstance(msg, Stats):
                    self.loop.call_soon_threadsafe(self._answered, StatsRequest, msg.info)
                elif isinstance(msg, Cleared):
                    self.loop.call_soon_threadsafe(self._answered, ClearCaches, msg.info)
                elif isinstance(msg, Grown):
                    self.loop.call_soon_threadsafe(self._answered, Grow, msg.info)
        except (EOFError, OSError):
            pass
        # the writer waits on its outbox: end it, then close the pipe (neither outlives the worker)
        self._outbox.put(_GONE)
        self._writer.join(5.0)
        self._conn.close()
        self.process.join(5.0)
        code = self.process.exitcode
        try:
            self.loop.call_soon_threadsafe(self._exited, code)
        except RuntimeError:  # the event loop is closed: the daemon is shutting down
            pass

    def _dispatch(self, events: list[Event]) -> None:
        for ev in events:
            queue = self._queues.get(ev.id)
            if queue is not None:
                queue.put_nowait(ev)

    def _set_loaded(self, msg: Loaded) -> None:
        if self._loaded.done():
            return
        if msg.error:
            self._loaded.set_exception(from_wire(msg.error))
        else:
            self.info = msg.info
            self._loaded.set_result(msg.info)

    def _exited(self, code: int | None) -> None:
        with self._lock:
            self.alive = False
            queues, self._queues = self._queues, {}
        if self._row is not None:  # a dead worker's claim must pause nobody
            self._board.give_back(self._row)
            self._row = None
        if self.cfg is None:  # a standby that never took a model
            if self._on_exit:
                self._on_exit(self)
            return
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        if self.hung_for is not None:
            how = f"stopped answering for {self.hung_for:.0f} s (LLMD_HANG_S) and was stopped"
        # a worker told to stop (the daemon shutting down) cut its requests: the server is unavailable
        # for a moment (503, as for a restart), nothing crashed (500)
        err: LlmdError = ModelUnavailable(
            f"llmd stopped the engine worker for {self.cfg.model_name} (the daemon is shutting down or "
            "restarting) during this request; retry the request when llmd is back"
        ) if self.stopping and self.hung_for is None else EngineCrashed(
            f"the engine worker for {self.cfg.model_name} {how} during this request; "
            "the next request starts a new worker"
        )
        for rid, queue in queues.items():
            queue.put_nowait(ErrorEvent(rid, err.to_wire()))
        if not self._loaded.done():
            self._loaded.set_exception(EngineCrashed(f"the engine worker for {self.cfg.model_name} {how} while loading"))
            self._loaded.exception()  # mark retrieved: nobody may be waiting
        for command in list(self._asked):  # nobody waits for an answer that cannot come
            self._answered(command, {})
        if self.stopping and self.hung_for is None:
            log.info("worker for %s (pid %s) stopped (%s)", self.cfg.model_name, self.pid, how)
        elif code not in (0, None):
            log.error("worker for %s (pid %s) %s", self.cfg.model_name, self.pid, how)
        if self._on_exit:
            self._on_exit(self)
