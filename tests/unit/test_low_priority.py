"""Idle work runs at nice 19 (issue 51): the thread's niceness is what the OS reports, the caller
keeps its own, and the CPU seconds spent there are counted."""

from __future__ import annotations

import os
import threading
import time

from llmd.backends.low_priority import IdleThread


def test_the_idle_work_thread_runs_at_nice_19_and_counts_its_cpu():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    low = IdleThread("test-idle")
    try:
        assert low.priority == "nice 19"
        assert low.run(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())) == 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller is not lowered

        def spin() -> int:
            end = time.process_time() + 0.2
            while time.process_time() < end:
                pass
            return 7

        assert low.run(spin) == 7
        assert low.runs == 2 and low.cpu_s >= 0.2
    finally:
        low.close()
