"""The TensorRT LLM class (builds or loads engines), with its own, wider, arguments (TrtLlmArgs).
Its speculation is built into the engine: Lookahead, Medusa or Eagle, never the PyTorch kinds."""

from __future__ import annotations

from . import LLM as _TorchLLM
from . import TORCH_ARGS, llmapi


class LLM(_TorchLLM):
    ARGS = (TORCH_ARGS - {"disable_overlap_scheduler", "enable_chunked_prefill"}) | {
        "build_config", "quant_config", "calib_config", "enable_build_cache"}
    SPECULATION = (llmapi.LookaheadDecodingConfig,)

    def _check_arguments(self, prompt_len: int, params: llmapi.SamplingParams) -> None:
        if prompt_len > self.max_input_len:
            raise ValueError(f"The prompt length ({prompt_len}) should not exceed max_input_len "
                             f"({self.max_input_len})")
        super()._check_arguments(prompt_len, params)
