"""The dashboard's history points: draft acceptance comes from the requests in the window."""

from __future__ import annotations

from llmd.backends.base import Usage
from llmd.daemon.metrics import Metrics


def usage(drafted: int, accepted: int) -> Usage:
    return Usage(prompt_tokens=10, completion_tokens=20, cached_tokens=0, ttft_s=0.1, prefill_s=0.05, decode_s=0.5,
                 drafted_tokens=drafted, accepted_tokens=accepted)


def test_draft_acceptance_in_history():
    m = Metrics()
    m.observe("smollm2-135m", "openai", "ok", 0.1, [], 0.6, usage(10, 8), "miss")
    m.observe("smollm2-135m", "openai", "ok", 0.1, [], 0.6, usage(30, 12), "bypass")
    m.observe("smollm2-135m", "openai", "ok", 0.0, [], 0.01, usage(50, 50), "hit")  # a replay drafted nothing
    assert m.sample({"loaded": []})["draft_acceptance"] == 0.5
    assert m.sample({"loaded": []})["draft_acceptance"] is None  # nothing drafted since
    assert b'llmd_accepted_tokens_total{api="openai",backend="llama.cpp",model="smollm2-135m"} 20.0' in m.render()
