"""Values the API reports are the model's and the machine's own, and what keeps them is bounded."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from llmd.backends.base import Usage
from llmd.daemon import metrics as metrics_mod
from llmd.daemon.metrics import Metrics
from llmd.daemon.routes.ollama import _vram, capabilities
from llmd.daemon.stored_responses import StoredResponses
from llmd.models.catalog import find_packaged
from llmd.models.gguf import GGUFInfo, read_gguf


def info(arch: str, **meta: object) -> GGUFInfo:
    return GGUFInfo(Path("x.gguf"), 3, {"general.architecture": arch, **meta}, 0, 0, 0)


def test_capabilities_are_what_each_model_can_do():
    smol = read_gguf(find_packaged()["smollm2-135m"])
    assert capabilities(smol) == ["completion"]  # its template renders no tools: no "tools", no "embedding"
    qwen = info("qwen2", **{"tokenizer.chat_template": "{% if tools %}<tools>{% endif %}<tool_call>"})
    assert capabilities(qwen) == ["completion", "tools"]
    assert capabilities(info("nomic-bert", **{"nomic-bert.pooling_type": 1})) == ["embedding"]
    assert capabilities(info("qwen3", **{"qwen3.pooling_type": 3})) == ["embedding"]  # an embedding finetune
    thinker = info("qwen3", **{"tokenizer.chat_template": "{{ tools }}<tool_call><think>"})
    assert capabilities(thinker) == ["completion", "tools", "thinking"]


def test_size_vram_is_the_share_on_the_gpu():
    assert _vram({"engine": "llama.cpp", "gpu_layers": 0, "n_layer": 28}, 1000) == 0
    assert _vram({"engine": "llama.cpp", "gpu_layers": 14, "n_layer": 28}, 1000) == 500
    assert _vram({"engine": "llama.cpp", "gpu_layers": 28, "n_layer": 28}, 1000) == 1000
    assert _vram({"engine": "tensorrt"}, 1000) == 1000


def test_a_failing_sampler_says_so_and_its_window_stays_bounded(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(metrics_mod, "WINDOW_MAX", 50)
    m = Metrics(lambda name: True)
    calls = 0

    async def broken() -> dict:
        nonlocal calls
        calls += 1
        for _ in range(40):
            m.observe("m", "openai", "ok", 0.1, [], 0.2, Usage(5, 5, 0, 0.1, 0.1, 0.1), "miss")
        if calls >= 4:
            raise asyncio.CancelledError
        raise RuntimeError("status broke")

    with caplog.at_level(logging.ERROR, logger="llmd.metrics"), pytest.raises(asyncio.CancelledError):
        asyncio.run(m.run_sampler(broken, period=0))
    assert m.sampler_errors == 3
    assert len(m._window) <= 50
    assert [r for r in caplog.records if "dashboard sampler failed" in r.getMessage()]  # once, rate-limited
    assert len([r for r in caplog.records if "dashboard sampler failed" in r.getMessage()]) == 1


def test_the_responses_store_is_bounded_oldest_first(tmp_path: Path):
    store = StoredResponses(tmp_path / "responses_api.db", max_bytes=20_000)
    big = [{"role": "user", "content": "x" * 1000}]
    for i in range(60):
        store.put(f"resp_{i}", "m", big, {"id": f"resp_{i}"})
    st = store.stats()
    assert st["bytes"] <= 20_000 and st["pruned"] > 0
    assert store.get("resp_59") is not None and store.get("resp_0") is None  # the newest kept, the oldest gone
    again = StoredResponses(tmp_path / "responses_api.db", max_bytes=20_000)
    assert again.stats()["bytes"] == st["bytes"]  # counted the same from the file
    assert again.delete("resp_59") and again.stats()["bytes"] < st["bytes"]
