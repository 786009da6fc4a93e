"""tensorrt_llm.llmapi's config classes, keyword-only and strict (as pydantic models with extra="forbid")."""

from __future__ import annotations

from typing import Any


class _Config:
    FIELDS: set[str] = set()

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - self.FIELDS
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown fields {sorted(unknown)}")
        self.__dict__.update(kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class KvCacheConfig(_Config):
    FIELDS = {"enable_block_reuse", "host_cache_size", "free_gpu_memory_fraction", "dtype"}


class BuildConfig(_Config):
    FIELDS = {"max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"}


class QuantConfig(_Config):
    FIELDS = {"quant_algo", "kv_cache_quant_algo"}


class CalibConfig(_Config):
    FIELDS = {"calib_dataset", "calib_batches", "calib_max_seq_length"}


class DraftTargetDecodingConfig(_Config):
    FIELDS = {"max_draft_len", "speculative_model"}


class NGramDecodingConfig(_Config):
    FIELDS = {"max_draft_len", "max_matching_ngram_size"}


class GuidedDecodingParams(_Config):
    FIELDS = {"json", "regex", "grammar", "json_object"}


class SamplingParams(_Config):
    FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "stop", "guided_decoding", "return_perf_metrics"}
