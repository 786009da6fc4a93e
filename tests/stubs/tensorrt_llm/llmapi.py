"""tensorrt_llm.llmapi's config classes, keyword-only and strict (as pydantic models with extra="forbid"),
their fields and validators as in tensorrt_llm/llmapi/llm_args.py (see the package's docstring)."""

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


# DecodingBaseConfig's fields (llm_args.py)
_DECODING = {"max_draft_len", "max_total_draft_tokens", "speculative_model", "speculative_model_dir",
             "max_concurrency", "draft_len_schedule", "load_format", "acceptance_window",
             "acceptance_length_threshold", "allow_advanced_sampling"}


class DraftTargetDecodingConfig(_Config):
    FIELDS = _DECODING

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not kwargs.get("max_draft_len"):
            raise ValueError("max_draft_len must be > 0 for DraftTarget")
        if not (kwargs.get("speculative_model") or kwargs.get("speculative_model_dir")):
            raise ValueError("speculative_model must be specified for DraftTarget")


class NGramDecodingConfig(_Config):
    FIELDS = _DECODING | {"max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not kwargs.get("max_draft_len"):
            raise ValueError("max_draft_len must be > 0 for NGram")
        if kwargs.get("max_matching_ngram_size", 2) <= 0:
            raise ValueError("max_matching_ngram_size must be positive")


class LookaheadDecodingConfig(_Config):
    FIELDS = _DECODING | {"max_window_size", "max_ngram_size", "max_verification_set_size"}


class GuidedDecodingParams(_Config):
    FIELDS = {"json", "regex", "grammar", "json_object"}


class SamplingParams(_Config):
    FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "stop", "guided_decoding", "return_perf_metrics"}
