#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: check llmd's GPU paths. Not run on a GPU yet.
#   1. llama.cpp with CUDA: integration tests and the overhead benchmark with all layers on the GPU.
#   2. TensorRT-LLM, when tensorrt_llm imports: its unit tests (end to end needs HF checkpoints in the registry).
# Usage: bash benchmarks/gpu_check.sh   (from the repository root, after pip install -e '.[test]')
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,compute_cap,memory.total,memory.free --format=csv
python -m llmd doctor
python - <<'PY'
import llama_cpp, sys
if not llama_cpp.llama_supports_gpu_offload():
    sys.exit("llama-cpp-python has no GPU offload: CMAKE_ARGS='-DGGML_CUDA=on' pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36")
PY
export LLMD_GPU_LAYERS=999
python -m pytest -q -p no:cacheprovider tests/integration/test_openai_api.py tests/integration/test_ollama_api.py tests/integration/test_engine.py
python benchmarks/overhead.py --runs 5 --no-server
if python -c "import tensorrt_llm" 2>/dev/null; then
  python -m pytest -q -p no:cacheprovider tests/unit/test_tensorrt.py tests/unit/test_select.py
  echo "TensorRT-LLM needs a Hugging Face checkpoint; the registry takes only GGUF files so far, so the"
  echo "end-to-end TensorRT run is still to do (see README: GPUs)."
else
  echo "tensorrt_llm is not installed: TensorRT backend not checked"
fi
