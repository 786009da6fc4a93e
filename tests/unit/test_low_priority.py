"""Idle work runs at the OS's lowest priority (issue 51): the thread's niceness or class is what
the OS reports, and the CPU seconds spent there are counted."""

from __future__ import annotations

import os
import threading
import time

from llmd.backends.low_priority import IdleThread, lower_this_thread


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


def test_the_prefix_writer_class_is_sched_idle():
    got: list[object] = []

    def body() -> None:
        got.append(lower_this_thread(idle_class=True))
        got.append(os.sched_getscheduler(0))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert got == ["SCHED_IDLE", os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # only that thread
