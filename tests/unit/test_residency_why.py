"""Why a loaded model stays loaded (daemon/residency.py), as `llmd ps`, /llmd/status and the tray say."""

from __future__ import annotations

from llmd.daemon.residency import draft_copies, why_resident


def test_requests_then_a_pin_then_the_keep_alive():
    assert why_resident(2, 300, 0) == "serving 2 requests"
    assert why_resident(0, None, 900).startswith("pinned (keep_alive -1): stays until unloaded")
    assert why_resident(0, 300, 40) == ("idle 40 s; unloads after 5 min idle (keep_alive), or sooner when a load "
                                        "needs its memory (least recently used first)")
    assert why_resident(0, 300, 40, short=True) == "idle 40 s of 5 min"


def test_a_model_also_loaded_as_anothers_draft_says_what_the_copy_costs_and_why():
    loaded = [{"name": "coder-1.5b", "draft": "coder-0.5b",
               "stats": {"speculation": {"draft_model": {"rss_load_bytes": 612 * 1024 * 1024}}}},
              {"name": "coder-0.5b", "draft": None}]
    said = draft_copies("coder-0.5b", loaded)
    assert said.startswith("also loaded as the draft model of coder-1.5b (612 MiB there): a second copy")
    assert draft_copies("coder-1.5b", loaded) == ""
