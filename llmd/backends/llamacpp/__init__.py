"""The llama.cpp engine on llama-cpp-python's low-level API (imported lazily by name)."""
