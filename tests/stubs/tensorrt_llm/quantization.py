"""tensorrt_llm.quantization.QuantAlgo (the values llmd names)."""

from enum import Enum


class QuantAlgo(str, Enum):
    FP8 = "FP8"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"
    W8A16 = "W8A16"
    INT8 = "INT8"
