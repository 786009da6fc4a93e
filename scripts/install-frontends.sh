#!/usr/bin/env bash
# The front ends tests/integration/test_frontends.py drives, at pinned versions:
# Claude Code, Codex CLI and opencode from npm (tests/frontends/package.json); aider and Open WebUI from PyPI,
# each in its own virtual environment under ~/.cache/llmd/apps (they pin exact versions of openai,
# litellm, numpy, fastapi... that would fight the test environment's). Reused once installed.
# Open WebUI is the largest: about 7 GB and 4 minutes once.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
(cd tests/frontends && npm install --no-audit --no-fund --loglevel=error)
AIDER_VERSION=0.86.2
venv="$HOME/.cache/llmd/apps/aider-$AIDER_VERSION"
if ! "$venv/bin/aider" --version >/dev/null 2>&1; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "aider-chat==$AIDER_VERSION"
fi
OPEN_WEBUI_VERSION=0.12.4
venv="$HOME/.cache/llmd/apps/open-webui-$OPEN_WEBUI_VERSION"
if ! "$venv/bin/open-webui" --help >/dev/null 2>&1; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "open-webui==$OPEN_WEBUI_VERSION"
fi
