"""Models served by another engine over its OpenAI-compatible API (vLLM, SGLang, trtllm-serve,
llama-server, Ollama, another llmd): llmd's routes, caches and metrics in front, no local worker."""
