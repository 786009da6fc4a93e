"""Engines by name. Import strings keep llama_cpp and tensorrt_llm out of `import llmd`."""

ENGINES: dict[str, str] = {
    "llama.cpp": "llmd.backends.llamacpp.engine:LlamaCppEngine",
    "tensorrt": "llmd.backends.tensorrt.engine:TensorRTEngine",
}

__all__ = ["ENGINES"]
