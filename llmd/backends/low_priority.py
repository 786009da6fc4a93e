"""The OS's lowest priority for what llmd computes for itself (issue 51: idle work that costs the
desktop nothing).

A thread is put at nice 19: the scheduler then gives it about 1.5% of a core that another program
wants (Linux's SCHED_IDLE class: 0.3%), and all of one nobody wants.
It stays there for good, because an unprivileged thread cannot climb back (sched(7): RLIMIT_NICE),
so idle work gets a thread of its own (`IdleThread`) rather than lowering and raising the step
thread. llama.cpp's compute threads are started by the thread that decodes (OpenMP keeps a team
per calling thread) and inherit its priority, so a decode run there is low through and through.

The idle-work thread takes nice 19 rather than SCHED_IDLE: the step thread waits for it, and a
request arriving meanwhile is seen by its abort callback only when it runs, so its share under a
busy desktop bounds how long that request waits (at nice 19, a slice every few hundred ms at
worst). The prefix writer, which nothing waits for, was tried in SCHED_IDLE and fell behind under
an agent's steady load (snapshots skipped): it stays at normal priority.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("llmd.engine")
T = TypeVar("T")


def lower_this_thread() -> str:
    """Put the calling thread (and the threads it starts from now on) at nice 19; which priority
    it got, in words."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice 19"
    except (AttributeError, OSError) as e:
        log.info("idle work runs at normal priority: the OS refused a lower one (%s)", e)
        return f"normal (the OS refused a lower one: {e})"


class IdleThread:
    """One thread at the lowest priority that runs what it is given while the caller waits, and
    counts the CPU seconds the process spent meanwhile (the caller is blocked, so they are the idle
    work's: its llama.cpp threads included)."""

    def __init__(self, name: str = "llmd-idle") -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.priority = self._pool.submit(lower_this_thread).result()
        self.cpu_s = 0.0
        self.runs = 0

    def run(self, fn: Callable[..., T], *args: object) -> T:
        c0 = time.process_time()
        try:
            return self._pool.submit(fn, *args).result()
        finally:
            self.cpu_s += time.process_time() - c0
            self.runs += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)
