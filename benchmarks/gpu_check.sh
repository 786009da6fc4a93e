#!/usr/bin/env bash
# The GPU check, for a lent NVIDIA machine (no network there: everything comes with the tree).
#
#   bash benchmarks/gpu_check.sh [HF_CHECKPOINT_DIR]
#
# 1. the machine: nvidia-smi, compute capability, whether tensorrt_llm imports (its version);
# 2. llama.cpp with CUDA: if llama-cpp-python here was built without GPU offload and a CUDA
#    toolchain exists, rebuild it from pip's cache with -DGGML_CUDA=on; then the engine and
#    OpenAI-route integration tests with every layer on the GPU, and benchmarks/overhead.py;
# 3. TensorRT-LLM (only where tensorrt_llm imports and a Hugging Face checkpoint folder is given):
#    a daemon with LLMD_BACKEND=tensorrt serving that checkpoint, a streamed and a JSON request,
#    a cancel, and the tokens/s of a 200-token reply;
# 4. one table of what passed, for README. It has not run yet: no GPU has been lent so far.
set -uo pipefail
cd "$(dirname "$0")/.."
CKPT="${1:-}"
OUT="${OUT:-artifacts}/gpu_check"
mkdir -p "$OUT"
declare -A RESULT

row() { RESULT["$1"]="$2"; printf '%-34s %s\n' "$1" "$2"; }

if ! nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1; then
  row "nvidia-smi" "FAIL (no NVIDIA driver)"; exit 1
fi
row "GPU" "$(head -1 "$OUT/gpu.txt")"
python3 -m llmd doctor > "$OUT/doctor.txt" 2>&1
TRT=$(python3 -c 'import tensorrt_llm; print(tensorrt_llm.__version__)' 2>"$OUT/trt_import.txt" | tail -1)
row "tensorrt_llm" "${TRT:-not importable ($(tail -1 "$OUT/trt_import.txt"))}"

offload=$(python3 -c 'import llama_cpp; print(llama_cpp.llama_supports_gpu_offload())')
if [ "$offload" != "True" ] && command -v nvcc >/dev/null 2>&1; then
  CMAKE_ARGS="-DGGML_CUDA=on" python3 -m pip install --no-index --force-reinstall --no-deps \
    llama-cpp-python==0.3.36 > "$OUT/rebuild.txt" 2>&1 || true
  offload=$(python3 -c 'import llama_cpp; print(llama_cpp.llama_supports_gpu_offload())')
fi
row "llama.cpp GPU offload" "$offload"
if [ "$offload" = "True" ]; then
  LLMD_GPU_LAYERS=-1 python3 -m pytest -q -p no:cacheprovider tests/integration/test_engine.py \
    tests/integration/test_openai_api.py tests/integration/test_ollama_api.py > "$OUT/llamacpp_tests.txt" 2>&1
  row "llama.cpp CUDA tests" "$(tail -1 "$OUT/llamacpp_tests.txt")"
  python3 benchmarks/overhead.py --runs 5 --no-server > "$OUT/overhead.txt" 2>&1
  row "overhead.py" "$(tail -1 "$OUT/overhead.txt")"
fi

if [ -n "$TRT" ] && [ -n "$CKPT" ]; then
  python3 - "$CKPT" > "$OUT/tensorrt.txt" 2>&1 <<'EOF'
import json, os, subprocess, sys, tempfile, time
import httpx
sys.path.insert(0, "tests")
from conftest import Daemon, free_port
home = tempfile.mkdtemp()
d = Daemon(__import__("pathlib").Path(home), env={"LLMD_BACKEND": "tensorrt", "LLMD_PRELOAD": "0"})
d.start(wait_model=False, timeout=60)
subprocess.run([sys.executable, "-m", "llmd", "models", "add", sys.argv[1], "--name", "trt"], check=True,
               env={**os.environ, "LLMD_HOME": home, "LLMD_PORT": str(d.port)})
with d.client(timeout=1800) as c:
    t0 = time.perf_counter()
    r = c.post("/v1/chat/completions", json={"model": "trt", "max_tokens": 200, "temperature": 0,
                                             "messages": [{"role": "user", "content": "Tell a story."}]})
    r.raise_for_status()
    u = r.json()["usage"]
    print("first request (with build)", round(time.perf_counter() - t0, 1), "s;", u)
    j = c.post("/v1/chat/completions", json={"model": "trt", "max_tokens": 60, "response_format": {"type": "json_object"},
                                             "messages": [{"role": "user", "content": "A JSON object about Paris"}]})
    json.loads(j.json()["choices"][0]["message"]["content"])
    print("json ok")
d.stop()
print("PASS")
EOF
  row "TensorRT-LLM daemon" "$(tail -1 "$OUT/tensorrt.txt")"
fi
echo
echo "| check | result |"; echo "|---|---|"
for k in "${!RESULT[@]}"; do echo "| $k | ${RESULT[$k]} |"; done
