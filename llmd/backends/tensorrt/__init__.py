"""TensorRT-LLM engine (FP8/INT8). Imported by name only; tensorrt_llm loads lazily."""
