"""The TensorRT-LLM backend as far as it runs without a GPU: kwargs as data, the streaming
adapter against a stand-in with the same output objects, and the error without tensorrt_llm."""

import asyncio
import importlib.util
import inspect
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmd.backends.base import EngineConfig, FinalEvent, GenerationRequest, Sampling, TokenEvent
from llmd.backends.tensorrt import engine as trt
from llmd.errors import EngineError

CFG = EngineConfig(model_path="/models/llama-fp8", model_name="llama", n_ctx=4096, n_slots=4, chunk=64)


def test_module_imports_nothing_from_tensorrt_llm():
    assert "tensorrt_llm" not in sys.modules


def test_fp8_prequantized_uses_the_pytorch_llm_with_fp8_kv_and_reuse():
    kind, kw, notes = trt.llm_kwargs("fp8", "/models/llama-fp8", CFG, "/cache/trt/x", quantized=True)
    assert kind == "pytorch" and "quant_config" not in kw and not notes  # the PyTorch LLM rejects quant_config
    kv = kw["kv_cache_config"]
    assert kv == {"__class__": "KvCacheConfig", "enable_block_reuse": True, "host_cache_size": 2 * 1024**3,
                  "free_gpu_memory_fraction": 0.6, "dtype": "fp8"}
    assert kw["max_batch_size"] == 4 and kw["max_seq_len"] == 4096
    assert kw["guided_decoding_backend"] == "xgrammar"  # JSON requests fail without it
    assert "engine_cache_dir" not in kw  # not an LLM argument: the args model forbids unknown fields


def test_bf16_checkpoint_for_fp8_is_quantized_not_run_in_bf16():
    kind, kw, _ = trt.llm_kwargs("fp8", "/models/llama-bf16", CFG, "/cache/trt/x", quantized=False,
                                 calib_dir="/cache/calib-lambada")
    assert kind == "engine"
    assert kw["quant_config"] == {"__class__": "QuantConfig", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}


def test_pre_quantized_reads_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert not trt.pre_quantized(str(tmp_path))
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}')
    assert trt.pre_quantized(str(tmp_path))


def test_int8_builds_an_engine_with_a_calibration_folder_and_input_limits(tmp_path):
    calib = trt.calibration_dir(str(tmp_path))
    kind, kw, _ = trt.llm_kwargs("int8", "/models/llama", CFG, "/cache/trt/x", calib_dir=calib)
    assert kind == "engine"
    assert kw["quant_config"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    assert kw["calib_config"]["calib_dataset"] == calib
    # TensorRT-LLM's loader: load_dataset(folder) with split/column from the known name in the path
    assert "lambada" in Path(calib).name
    rows = [json.loads(line) for line in (Path(calib) / "validation.jsonl").read_text().splitlines()]
    assert len(rows) >= 32 and all(set(r) == {"text"} and r["text"] for r in rows)
    build = kw["build_config"]
    assert build["max_input_len"] == 4095 and build["max_num_tokens"] == 8192 and build["max_seq_len"] == 4096
    _, kw, _ = trt.llm_kwargs("int8-weight-only", "/m", CFG, "/c")
    assert kw["quant_config"]["quant_algo"] == "W8A16" and "calib_config" not in kw
    with pytest.raises(EngineError, match="fp8, int8"):
        trt.llm_kwargs("int4", "/m", CFG, "/c")


def test_a_built_engine_gets_only_runtime_options(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "rank0.engine").write_bytes(b"")
    assert trt.built_engine(str(tmp_path))
    kind, kw, notes = trt.llm_kwargs("int8", "/m", CFG, str(tmp_path), speculation="draft", draft_dir="/d",
                                     built=True)
    assert kind == "built" and set(kw) == {"model", "kv_cache_config", "guided_decoding_backend"}
    assert kw["model"] == str(tmp_path) and "draft model does not apply" in notes[0]


def test_speculation_configs():
    _, kw, _ = trt.llm_kwargs("fp8", "/m", CFG, "/c", speculation="draft", draft_dir="/d", quantized=True)
    assert kw["speculative_config"] == {"__class__": "DraftTargetDecodingConfig", "max_draft_len": 4,
                                        "speculative_model": "/d"}
    assert kw["disable_overlap_scheduler"] is True
    _, kw, _ = trt.llm_kwargs("fp8", "/m", CFG, "/c", speculation="ngram", quantized=True)
    assert kw["speculative_config"]["__class__"] == "NGramDecodingConfig"
    _, kw, notes = trt.llm_kwargs("int8", "/m", CFG, "/c", speculation="draft", draft_dir="/d")
    assert "speculative_config" not in kw and "does not apply" in notes[0]


def test_sampling_params():
    req = GenerationRequest(id="a", prompt="x", sampling=Sampling(temperature=0))
    kw = trt.sampling_kwargs(req, 4000)
    # max_tokens: the room the prompt leaves (the whole context would fail prompt + max_tokens <= max_seq_len)
    assert kw["max_tokens"] == 4000 and kw["temperature"] == 0 and kw["top_k"] == 1 and kw["return_perf_metrics"]
    sampled = trt.sampling_kwargs(GenerationRequest(id="b", prompt="x", sampling=Sampling(temperature=1.0)), 10)
    assert sampled["top_p"] == 1.0  # without top_p or top_k TensorRT-LLM would decode greedily
    req = GenerationRequest(id="a", prompt="x", max_tokens=7, stop=("\n",),
                            sampling=Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=3, presence_penalty=0.5),
                            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}})
    kw = trt.sampling_kwargs(req, 4096)
    assert kw["max_tokens"] == 7 and kw["top_p"] == 0.9 and kw["top_k"] == 40 and kw["seed"] == 3
    assert kw["stop"] == ["\n"] and kw["presence_penalty"] == 0.5
    assert kw["guided_decoding"] == {"__class__": "GuidedDecodingParams", "json": {"type": "object"}}


def test_both_engines_have_what_the_worker_uses():
    from llmd.backends.base import Engine
    from llmd.backends.llamacpp.engine import LlamaCppEngine

    members = [m for m in dir(Engine) if not m.startswith("_")] + list(Engine.__annotations__)
    for cls in (LlamaCppEngine, trt.TensorRTEngine):
        missing = [m for m in members if not hasattr(cls, m) and m not in ("profiler", "interrupt")]
        assert not missing, (cls.__name__, missing)
        src = inspect.getsource(cls.__init__)
        assert "self.profiler" in src and "self.interrupt" in src, cls.__name__


def test_materialize_builds_objects_from_descriptions():
    @dataclass
    class KvCacheConfig:
        enable_block_reuse: bool
        dtype: str = "auto"

    @dataclass
    class QuantConfig:
        quant_algo: object
        kv_cache_quant_algo: object = None

    ns = {"KvCacheConfig": KvCacheConfig, "QuantConfig": QuantConfig, "_enums": {"W8A16": "ENUM_W8A16"}}
    out = trt.materialize({"model": "/m", "kv": {"__class__": "KvCacheConfig", "enable_block_reuse": True},
                           "q": {"__class__": "QuantConfig", "quant_algo": "W8A16"}}, ns)
    assert out["kv"] == KvCacheConfig(True) and out["q"].quant_algo == "ENUM_W8A16"


@dataclass
class _Completion:
    text_diff: str
    token_ids: list[int]
    finish_reason: str | None = None
    request_perf_metrics: object = None


@dataclass
class _Output:
    outputs: list[_Completion]
    finished: bool
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])


@dataclass
class _Spec:
    total_draft_tokens: int = 8
    total_accepted_draft_tokens: int = 5


@dataclass
class _Perf:
    speculative_decoding: _Spec = field(default_factory=_Spec)


async def _stand_in():
    yield _Output([_Completion("Hel", [10])], False)
    yield _Output([_Completion("lo", [10, 11])], False)
    yield _Output([_Completion("", [10, 11, 12], "length", _Perf())], True)


def test_streaming_adapter():
    async def collect():
        return [ev async for ev in trt.stream_events("r1", _stand_in(), 0.0)]

    events = asyncio.run(collect())
    assert [e.text for e in events if isinstance(e, TokenEvent)] == ["Hel", "lo"]
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason == "length"
    assert final.usage.prompt_tokens == 3 and final.usage.completion_tokens == 3
    assert (final.usage.drafted_tokens, final.usage.accepted_tokens) == (8, 5)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed here")
def test_selected_without_tensorrt_llm_gives_a_clear_error():
    with pytest.raises(EngineError) as e:
        trt.TensorRTEngine(CFG)
    assert "tensorrt_llm is not installed" in str(e.value) and "LLMD_BACKEND=llama.cpp" in str(e.value)
