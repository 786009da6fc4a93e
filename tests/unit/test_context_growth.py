"""A context sized by use grows for a prompt that needs it once the model's other requests finish,
holding new ones meanwhile, and never holds them for longer than GROW_WAIT_S."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmd.config import load_settings
from llmd.daemon import scheduler as sched


@dataclass
class _Cfg:
    n_ctx: int = 8192
    ctx_ceiling: int = 32768


class _Worker:
    remote = False
    pid = 1

    def __init__(self) -> None:
        self.cfg, self.stopped = _Cfg(), False

    def shutdown(self) -> None:
        self.stopped = True


def _model_in_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, users: int) -> tuple[sched.Scheduler, _Worker]:
    s = sched.Scheduler(load_settings({"home": tmp_path}, env={}), registry=None)  # type: ignore[arg-type]
    monkeypatch.setattr(s, "_grow_refusal", lambda *_a: None)  # memory allows it
    w = _Worker()
    m = s.state("coder")
    m.worker, m.users = w, users  # type: ignore[assignment]
    return s, w


def test_it_grows_to_twice_the_context_once_the_other_request_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    s, w = _model_in_use(tmp_path, monkeypatch, users=2)  # the growing prompt's request and one stream

    async def run() -> tuple[str, bool]:
        grow = asyncio.ensure_future(s._grow_for_prompt("coder", 9000))
        await asyncio.sleep(0.2)
        s.state("coder").users += 1  # a new request arrives: it waits
        held = asyncio.ensure_future(s._growth_done("coder"))
        await asyncio.sleep(0.2)
        waiting = not held.done() and not grow.done()
        s.state("coder").users -= 1  # the stream ends
        return await grow, waiting and (await held) is None

    assert asyncio.run(run()) == ("grown", True)
    assert w.stopped and s.state("coder").ctx_wanted == 16384  # twice 8192 (9000 rounds to 12288)
    assert s.state("coder").growing is None


def test_a_stream_that_runs_on_does_not_hold_the_model_past_the_bound(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(sched, "GROW_WAIT_S", 0.3)
    s, w = _model_in_use(tmp_path, monkeypatch, users=2)

    async def run() -> tuple[str, bool]:
        grow = asyncio.ensure_future(s._grow_for_prompt("coder", 9000))
        await asyncio.sleep(0.05)
        s.state("coder").users += 1
        held = asyncio.ensure_future(s._growth_done("coder"))
        result = await grow
        await asyncio.wait_for(held, 1)  # released with it
        return result, held.done()

    assert asyncio.run(run()) == ("busy", True)
    assert not w.stopped and s.state("coder").growing is None
    assert "1 other requests were still running after 0 s; serving it within 8192" in caplog.text


def test_an_embedding_context_doubles_until_it_holds_the_input_up_to_its_ceiling():
    from llmd.backends.llamacpp.embeddings import grown_size

    assert grown_size(2048, 3001, 8192) == 4096
    assert grown_size(2048, 4096, 8192) == 4096
    assert grown_size(2048, 9000, 8192) == 8192
    assert grown_size(8192, 20000, 32768) == 32768
