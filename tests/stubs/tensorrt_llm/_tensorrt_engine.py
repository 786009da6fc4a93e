"""The TensorRT LLM class (builds or loads engines), with its own, wider, arguments."""

from __future__ import annotations

from . import LLM as _TorchLLM
from . import TORCH_ARGS


class LLM(_TorchLLM):
    ARGS = (TORCH_ARGS - {"disable_overlap_scheduler"}) | {"build_config", "quant_config", "calib_config",
                                                          "max_input_len", "enable_build_cache"}
