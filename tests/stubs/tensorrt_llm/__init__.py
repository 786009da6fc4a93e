"""A stand-in for tensorrt_llm 1.2 with the same names and signatures llmd uses (LLM, SamplingParams,
llmapi configs, the TensorRT LLM class, QuantAlgo), strict about unknown arguments as the real
pydantic args models are, for a contract test of llmd's TensorRT backend through its real worker
process. It generates a fixed text; every call is recorded in $TRT_STUB_RECORD (JSON lines)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from . import llmapi
from .llmapi import SamplingParams

__version__ = "1.2.1-stub"
TEXT = ["The", " lamp", " was", " lit", " at", " dusk", "."]

# the PyTorch LLM's arguments llmd may pass (tensorrt_llm/llmapi/llm_args.py: TorchLlmArgs)
TORCH_ARGS = {"model", "tokenizer", "max_batch_size", "max_num_tokens", "max_seq_len", "kv_cache_config",
              "speculative_config", "guided_decoding_backend", "disable_overlap_scheduler"}


def record(what: str, **data: Any) -> None:
    path = os.environ.get("TRT_STUB_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"call": what, **data}, default=repr) + "\n")


class _Tokenizer:
    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                            else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split()) + 1))


class _Completion:
    def __init__(self) -> None:
        self.text_diff = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None


class _RequestOutput:
    """What generate_async returns: an async iterator of itself, updated in place, with abort()."""

    def __init__(self, prompt: str, params: SamplingParams, delay: float) -> None:
        self.prompt_token_ids = list(range(len(prompt.split()) + 1))
        self.outputs = [_Completion()]
        self.finished = False
        self._params = params
        self._delay = delay
        self._aborted = False

    def abort(self) -> None:
        record("abort")
        self._aborted = True

    def __aiter__(self) -> _RequestOutput:
        return self

    async def __anext__(self) -> _RequestOutput:
        o = self.outputs[0]
        if self.finished or self._aborted:
            raise StopAsyncIteration
        await asyncio.sleep(self._delay)
        i = len(o.token_ids)
        o.text_diff = TEXT[i % len(TEXT)]
        o.token_ids.append(i)
        if len(o.token_ids) >= self._params.max_tokens:
            self.finished, o.finish_reason = True, "length"
        return self


class LLM:
    ARGS = TORCH_ARGS

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - self.ARGS
        if unknown:  # the real args model forbids extra fields
            raise ValueError(f"{type(self).__name__}: unknown arguments {sorted(unknown)}")
        record("LLM", cls=f"{type(self).__module__}.{type(self).__name__}", kwargs=kwargs)
        self.tokenizer = _Tokenizer()
        self.args = kwargs

    def generate_async(self, prompt: str, sampling_params: SamplingParams, streaming: bool = False) -> _RequestOutput:
        record("generate_async", prompt=prompt, params=vars(sampling_params), streaming=streaming)
        return _RequestOutput(prompt, sampling_params, float(os.environ.get("TRT_STUB_DELAY", "0.01")))

    def save(self, engine_dir: str) -> None:
        record("save", engine_dir=engine_dir)

    def shutdown(self) -> None:
        record("shutdown")


__all__ = ["LLM", "SamplingParams", "llmapi"]
