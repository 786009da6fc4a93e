"""The TensorRT-LLM backend through llmd's real worker process, against a stand-in tensorrt_llm
package (tests/stubs) with 1.2's names and signatures and its strictness about unknown
arguments: the worker contract (info, profiler, interrupt, preload), the LLM class and arguments
for each kind of model folder, SamplingParams, streaming, cancellation reaching abort(), and
shutdown. No GPU here: this checks llmd's side of the contract, not TensorRT-LLM."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd.backends.base import EngineConfig, ErrorEvent, FinalEvent, GenerationRequest, Sampling, TokenEvent
from llmd.backends.worker import WorkerHandle

pytestmark = pytest.mark.integration
STUBS = str(Path(__file__).resolve().parents[1] / "stubs")


@pytest.fixture
def stub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("TRT_STUB_RECORD", str(record))
    monkeypatch.syspath_prepend(STUBS)  # the spawned worker inherits sys.path; this process never imports it
    yield record
    sys.modules.pop("tensorrt_llm", None)


def calls(record: Path, what: str) -> list[dict]:
    return [c for c in map(json.loads, record.read_text().splitlines()) if c["call"] == what]


def checkpoint(tmp_path: Path, quantized: bool) -> str:
    d = tmp_path / ("ckpt-fp8" if quantized else "ckpt-bf16")
    d.mkdir()
    config = {"architectures": ["LlamaForCausalLM"]}
    if quantized:
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def cfg(tmp_path: Path, model_path: str) -> EngineConfig:
    return EngineConfig(model_path=model_path, model_name="stub", n_ctx=512, n_slots=2, chunk=64, precision="fp8",
                        model_digest="d1", prefix_dir=str(tmp_path / "cache" / "prefix"))


async def collect(worker: WorkerHandle, req: GenerationRequest) -> list:
    queue = worker.submit(req)
    events = []
    while True:
        ev = await asyncio.wait_for(queue.get(), 30)
        events.append(ev)
        if isinstance(ev, FinalEvent | ErrorEvent):
            return events


def test_a_pre_quantized_checkpoint_streams_through_the_worker(tmp_path: Path, stub_env: Path):
    async def main() -> tuple[dict, list, list, dict]:
        w = WorkerHandle("tensorrt", cfg(tmp_path, checkpoint(tmp_path, True)), asyncio.get_running_loop())
        try:
            info = await w.wait_loaded()
            chat = await collect(w, GenerationRequest("r1", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=5, sampling=Sampling(temperature=0)))
            raw = await collect(w, GenerationRequest("r2", prompt="Once", raw=True, max_tokens=3,
                                                     sampling=Sampling(temperature=0.7, top_p=0.9, seed=3),
                                                     response_format={"type": "json_object"}))
            stats = await w.stats()
            return info, chat, raw, stats
        finally:
            await asyncio.to_thread(w.shutdown)

    info, chat, raw, stats = asyncio.run(main())
    assert info["engine"] == "tensorrt" and info["tensorrt_llm"] == "1.2.1-stub"
    assert "".join(e.text for e in chat if isinstance(e, TokenEvent)) == "The lamp was lit at"
    final = chat[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason == "length" and final.usage.completion_tokens == 5
    assert isinstance(raw[-1], FinalEvent) and raw[-1].usage.completion_tokens == 3
    assert stats["slots"] == 2
    [llm] = calls(stub_env, "LLM")
    assert llm["cls"] == "tensorrt_llm.LLM"  # the PyTorch LLM for a pre-quantized checkpoint
    assert llm["kwargs"]["guided_decoding_backend"] == "xgrammar" and llm["kwargs"]["max_seq_len"] == 512
    greedy, sampled = (c["params"] for c in calls(stub_env, "generate_async"))
    assert greedy["max_tokens"] == 5 and greedy["top_k"] == 1
    assert sampled["top_p"] == 0.9 and sampled["seed"] == 3 and "guided_decoding" in sampled
    assert calls(stub_env, "generate_async")[0]["prompt"] == "<user>Hi<assistant>"  # the model's own template
    assert calls(stub_env, "shutdown")


def test_a_bf16_checkpoint_is_built_once_with_the_tensorrt_llm_and_saved(tmp_path: Path, stub_env: Path):
    async def main() -> dict:
        w = WorkerHandle("tensorrt", cfg(tmp_path, checkpoint(tmp_path, False)), asyncio.get_running_loop())
        try:
            return await w.wait_loaded()
        finally:
            await asyncio.to_thread(w.shutdown)

    asyncio.run(main())
    [llm] = calls(stub_env, "LLM")
    assert llm["cls"] == "tensorrt_llm._tensorrt_engine.LLM"
    assert {"quant_config", "calib_config", "build_config"} <= set(llm["kwargs"])
    [saved] = calls(stub_env, "save")
    assert "trt-engines" in saved["engine_dir"]


def test_cancelling_aborts_the_request_inside_tensorrt_llm(tmp_path: Path, stub_env: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TRT_STUB_DELAY", "0.2")

    async def main() -> list:
        w = WorkerHandle("tensorrt", cfg(tmp_path, checkpoint(tmp_path, True)), asyncio.get_running_loop())
        try:
            await w.wait_loaded()
            queue = w.submit(GenerationRequest("long", prompt="Go", raw=True, max_tokens=200))
            first = await asyncio.wait_for(queue.get(), 30)
            w.cancel("long")
            await asyncio.sleep(1.0)
            return [first]
        finally:
            await asyncio.to_thread(w.shutdown)

    [first] = asyncio.run(main())
    assert isinstance(first, TokenEvent)
    assert calls(stub_env, "abort")  # the request stopped in TensorRT-LLM, not only our task
