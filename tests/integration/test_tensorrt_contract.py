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


def cfg(tmp_path: Path, model_path: str, **kw: object) -> EngineConfig:
    base: dict = {"model_path": model_path, "model_name": "stub", "n_ctx": 512, "n_slots": 2, "chunk": 64,
                  "precision": "fp8", "model_digest": "d1", "prefix_dir": str(tmp_path / "cache" / "prefix")}
    return EngineConfig(**{**base, **kw})


def run(c: EngineConfig, *reqs: GenerationRequest) -> tuple[dict, list[list]]:
    async def main() -> tuple[dict, list[list]]:
        w = WorkerHandle("tensorrt", c, asyncio.get_running_loop())
        try:
            info = await w.wait_loaded()
            return info, [await collect(w, r) for r in reqs]
        finally:
            await asyncio.to_thread(w.shutdown)

    return asyncio.run(main())


HI = [{"role": "user", "content": "Hi there"}]


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
    # the model's own template, which writes BOS: the ids TensorRT-LLM gets hold it once
    assert calls(stub_env, "generate_async")[0]["prompt_token_ids"] == [1, 100]
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


def test_max_tokens_unset_fills_the_room_tensorrt_llm_checks(tmp_path: Path, stub_env: Path):
    """No max_tokens: the rest of max_seq_len after the prompt as TensorRT-LLM counts it (BOS once);
    with BOS counted twice, or not at all, TensorRT-LLM refuses the request."""
    info, [events] = run(cfg(tmp_path, checkpoint(tmp_path, True)),
                         GenerationRequest("r", messages=HI, sampling=Sampling(temperature=0)))
    assert isinstance(events[-1], FinalEvent), events[-1]
    [gen] = calls(stub_env, "generate_async")
    assert gen["prompt_token_ids"].count(1) == 1
    assert gen["params"]["max_tokens"] == 512 - len(gen["prompt_token_ids"]) and info["max_seq_len"] == 512


def test_a_built_engine_is_held_to_its_own_limits(tmp_path: Path, stub_env: Path):
    """The BF16 checkpoint is built and saved; the next load takes the saved engine, whose own
    max_seq_len and max_input_len (from its config.json) decide the room and refuse a prompt."""
    model = checkpoint(tmp_path, False)
    run(cfg(tmp_path, model))
    info, (ok, long) = run(cfg(tmp_path, model, n_ctx=4096),  # the engine was built for 512
                           GenerationRequest("a", messages=HI, sampling=Sampling(temperature=0)),
                           GenerationRequest("b", messages=[{"role": "user", "content": "word " * 600}]))
    assert info["max_seq_len"] == 512 and info["max_input_len"] == 511
    assert isinstance(ok[-1], FinalEvent)
    gen = calls(stub_env, "generate_async")[0]
    assert gen["params"]["max_tokens"] == 512 - len(gen["prompt_token_ids"])
    assert isinstance(long[-1], ErrorEvent) and "at most 511" in str(long[-1].error), long[-1]
    assert [c["cls"] for c in calls(stub_env, "LLM")][-1] == "tensorrt_llm._tensorrt_engine.LLM"


def test_speculation_is_configured_when_the_llm_is_made(tmp_path: Path, stub_env: Path):
    draft = tmp_path / "draft-hf"
    draft.mkdir()
    model = checkpoint(tmp_path, True)
    info, _ = run(cfg(tmp_path, model, speculation="ngram"))
    assert calls(stub_env, "LLM")[-1]["kwargs"]["speculative_config"].startswith("NGramDecodingConfig")
    assert info["speculation"] == {"mode": "ngram", "asked": "ngram", "per_request": False}
    info, _ = run(cfg(tmp_path, model, speculation="auto", draft_path=str(draft)))
    kwargs = calls(stub_env, "LLM")[-1]["kwargs"]
    assert kwargs["speculative_config"].startswith("DraftTargetDecodingConfig") and str(draft) in kwargs[
        "speculative_config"] and kwargs["disable_overlap_scheduler"] is True
    assert info["speculation"]["mode"] == "draft"
    # a TensorRT engine takes no n-gram or draft model: built without, and status says how to rebuild
    bf16 = checkpoint(tmp_path, False)
    info, _ = run(cfg(tmp_path, bf16, speculation="ngram"))
    assert "speculative_config" not in calls(stub_env, "LLM")[-1]["kwargs"]
    assert info["speculation"]["mode"] == "off" and "Lookahead" in info["notes"][0]
