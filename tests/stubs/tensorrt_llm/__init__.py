"""A stand-in for tensorrt_llm 1.2, for a contract test of llmd's TensorRT backend through its real
worker process. It is strict where the real package is strict, following TensorRT-LLM's own
sources (NVIDIA/TensorRT-LLM, read with the search tool; not llmd's code):

- tensorrt_llm/llmapi/llm_args.py: every args and config class is a StrictBaseModel (pydantic,
  extra="forbid"), so an unknown keyword is an error; the LLM classes take TorchLlmArgs /
  TrtLlmArgs fields only (the subsets below are fields those classes have). DecodingBaseConfig
  holds max_draft_len, max_total_draft_tokens, speculative_model (alias speculative_model_dir),
  max_concurrency, draft_len_schedule, load_format, acceptance_window,
  acceptance_length_threshold and allow_advanced_sampling; NGramDecodingConfig adds
  max_matching_ngram_size, is_keep_all, is_use_oldest, is_public_pool and requires
  max_draft_len > 0; DraftTargetDecodingConfig requires max_draft_len > 0 and a
  speculative_model. Both run on the PyTorch LLM only (supports_backend == "pytorch"); the
  TensorRT engine LLM takes Lookahead, Medusa or Eagle.
- tensorrt_llm/llmapi/llm.py (_check_arguments): a request whose prompt length plus max_tokens is
  more than max_seq_len fails with "The sum of prompt length (...) and query length (0)
  max_tokens (...) should not exceed max_seq_len (...)"; on a TensorRT engine a prompt longer
  than max_input_len fails too. generate_async takes a string (encoded with the tokenizer's
  special tokens, so BOS is added) or a list of token ids (taken as they are).
- The tokenizer is the checkpoint's: its chat template writes BOS itself (as Llama's does), so a
  rendered chat encoded with special tokens starts with BOS twice.
- LLM.save(dir) writes a folder that loads as an engine: config.json with the build_config,
  beside rank0.engine; an LLM made from that folder enforces its max_seq_len and max_input_len.

It generates a fixed text; every call is recorded in $TRT_STUB_RECORD (JSON lines)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from . import llmapi
from .llmapi import SamplingParams

__version__ = "1.2.1-stub"
TEXT = ["The", " lamp", " was", " lit", " at", " dusk", "."]
BOS = 1

# TorchLlmArgs fields (the PyTorch LLM); speculative configs of the PyTorch kinds only
TORCH_ARGS = {"model", "tokenizer", "max_batch_size", "max_num_tokens", "max_seq_len", "max_input_len",
              "kv_cache_config", "speculative_config", "guided_decoding_backend", "disable_overlap_scheduler",
              "enable_chunked_prefill"}
TORCH_SPECULATION = (llmapi.NGramDecodingConfig, llmapi.DraftTargetDecodingConfig)


def record(what: str, **data: Any) -> None:
    path = os.environ.get("TRT_STUB_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"call": what, **data}, default=repr) + "\n")


class _Tokenizer:
    """A word tokenizer whose chat template starts with BOS, as a checkpoint's does."""

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        text = "<s>" + "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        if text.startswith("<s>"):
            ids.append(BOS)
            text = text[3:]
        ids += [100 + i for i in range(len(text.split()))]
        return ([BOS] if add_special_tokens else []) + ids


class _Completion:
    def __init__(self) -> None:
        self.text_diff = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None


class _RequestOutput:
    """What generate_async returns: an async iterator of itself, updated in place, with abort()."""

    def __init__(self, ids: list[int], params: SamplingParams, delay: float) -> None:
        self.prompt_token_ids = ids
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
    SPECULATION: tuple[type, ...] = TORCH_SPECULATION

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - self.ARGS
        if unknown:  # the real args model forbids extra fields
            raise ValueError(f"{type(self).__name__}: unknown arguments {sorted(unknown)}")
        spec = kwargs.get("speculative_config")
        if spec is not None and not isinstance(spec, self.SPECULATION):
            raise ValueError(f"{type(spec).__name__} is not supported by {type(self).__name__}")
        record("LLM", cls=f"{type(self).__module__}.{type(self).__name__}", kwargs=kwargs)
        self.tokenizer = _Tokenizer()
        self.args = kwargs
        build = kwargs.get("build_config")
        engine = Path(str(kwargs.get("model", ""))) / "config.json"
        saved = json.loads(engine.read_text()).get("build_config", {}) if engine.is_file() else {}
        self.max_seq_len = int(saved.get("max_seq_len") or getattr(build, "max_seq_len", 0)
                               or kwargs.get("max_seq_len") or 8192)
        self.max_input_len = int(saved.get("max_input_len") or getattr(build, "max_input_len", 0)
                                 or kwargs.get("max_input_len") or self.max_seq_len)

    def generate_async(self, inputs: str | list[int], sampling_params: SamplingParams,
                       streaming: bool = False) -> _RequestOutput:
        ids = self.tokenizer.encode(inputs, add_special_tokens=True) if isinstance(inputs, str) else list(inputs)
        record("generate_async", prompt=inputs, prompt_token_ids=ids, params=vars(sampling_params),
               streaming=streaming)
        self._check_arguments(len(ids), sampling_params)
        return _RequestOutput(ids, sampling_params, float(os.environ.get("TRT_STUB_DELAY", "0.01")))

    def _check_arguments(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len + params.max_tokens > self.max_seq_len:
            raise ValueError(f"The sum of prompt length ({float(prompt_len)}) and query length (0) max_tokens "
                             f"({params.max_tokens}) should not exceed max_seq_len ({self.max_seq_len})")

    def save(self, engine_dir: str) -> None:
        record("save", engine_dir=engine_dir)
        d = Path(engine_dir)
        d.mkdir(parents=True, exist_ok=True)
        build = self.args.get("build_config")
        (d / "config.json").write_text(json.dumps({"build_config": vars(build) if build is not None else {}}))
        (d / "rank0.engine").write_bytes(b"stub engine")

    def shutdown(self) -> None:
        record("shutdown")


__all__ = ["LLM", "SamplingParams", "llmapi"]
