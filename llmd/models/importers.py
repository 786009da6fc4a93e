"""Models a user already downloaded with another tool, found on disk and registered in place.

Read-only: llmd never moves, changes or deletes another tool's files (the registry rows say
source "ollama" | "lmstudio" | "hf", and `llmd models rm` only unregisters them).

- Ollama: `$OLLAMA_MODELS` or `~/.ollama/models`. A manifest at
  `manifests/<host>/<namespace>/<model>/<tag>` lists layers; the
  `application/vnd.ollama.image.model` layer is the GGUF at `blobs/sha256-<hex>` (its name is its
  digest, so nothing is hashed again). Its `params` and `system` layers are kept as the model's
  Ollama defaults (shown, not applied yet); the Go `template` layer is not Jinja, so the GGUF's own
  template is used.
- LM Studio: `~/.lmstudio/models/<publisher>/<repo>/*.gguf` (or the older `~/.cache/lm-studio/models`).
- The Hugging Face cache: `$HF_HUB_CACHE`, `$HF_HOME/hub` or `~/.cache/huggingface/hub`,
  `models--<org>--<repo>/snapshots/<rev>/*.gguf` (symlinks into `blobs/<sha256>`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmd.models.gguf import read_gguf

OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_PARAMS = "application/vnd.ollama.image.params"
OLLAMA_SYSTEM = "application/vnd.ollama.image.system"
PROJECTOR_ARCHS = {"clip", "mllama_vision"}  # vision projectors: not language models


@dataclass
class Found:
    """One model file another tool keeps, and what llmd would register it as."""

    source: str  # ollama | lmstudio | hf
    name: str
    path: Path
    size: int
    digest: str | None = None  # sha256:<hex> when the store names files by digest
    arch: str = ""
    quantization: str = ""
    skip: str | None = None  # why it cannot be imported
    defaults: dict[str, Any] = field(default_factory=dict)  # Ollama params / system

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "name": self.name, "path": str(self.path), "size": self.size,
                "arch": self.arch, "quantization": self.quantization, "skip": self.skip, "defaults": self.defaults}


def _home() -> Path:
    return Path(os.environ.get("HOME") or Path.home())


def ollama_root() -> Path:
    return Path(os.environ["OLLAMA_MODELS"]) if os.environ.get("OLLAMA_MODELS") else _home() / ".ollama" / "models"


def lmstudio_roots() -> list[Path]:
    return [_home() / ".lmstudio" / "models", _home() / ".cache" / "lm-studio" / "models"]


def hf_root() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return _home() / ".cache" / "huggingface" / "hub"


def _blob(root: Path, digest: str) -> Path:
    return root / "blobs" / digest.replace(":", "-")


def _ollama_name(rel: Path) -> str:
    host, namespace, model, tag = rel.parts[-4:]
    if host == "registry.ollama.ai" and namespace == "library":
        return f"{model}:{tag}"
    if host == "registry.ollama.ai":
        return f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def find_ollama(root: Path | None = None) -> list[Found]:
    root = root or ollama_root()
    out: list[Found] = []
    manifests = root / "manifests"
    if not manifests.is_dir():
        return out
    for path in sorted(p for p in manifests.rglob("*") if p.is_file()):
        rel = path.relative_to(manifests)
        if len(rel.parts) < 4:
            continue
        try:
            manifest = json.loads(path.read_text())
            layers = {layer["mediaType"]: layer for layer in manifest.get("layers", [])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            out.append(Found("ollama", _ollama_name(rel), path, 0, skip=f"unreadable manifest: {e}"))
            continue
        model = layers.get(OLLAMA_MODEL)
        if model is None:
            out.append(Found("ollama", _ollama_name(rel), path, 0, skip="the manifest has no model layer"))
            continue
        found = Found("ollama", _ollama_name(rel), _blob(root, model["digest"]), int(model.get("size", 0)),
                      digest=model["digest"])
        for kind, key in ((OLLAMA_PARAMS, "params"), (OLLAMA_SYSTEM, "system")):
            if kind in layers:
                try:
                    text = _blob(root, layers[kind]["digest"]).read_text()
                    found.defaults[key] = json.loads(text) if key == "params" else text
                except (OSError, ValueError):
                    pass
        out.append(found)
    return out


def _name(repo: str, file: Path) -> str:
    """`qwen2.5-0.5b-instruct:q4_k_m` from a repo name and a file like `...-Q4_K_M.gguf`."""
    base = re.sub(r"-gguf$", "", repo.lower())
    m = re.search(r"[-.]((?:i?q\d[\w]*)|f16|bf16|f32)$", file.stem, re.I)
    return f"{base}:{m.group(1).lower()}" if m else f"{base}:{file.stem.lower()}"


def find_lmstudio(roots: list[Path] | None = None) -> list[Found]:
    out: list[Found] = []
    for root in roots or lmstudio_roots():
        if not root.is_dir():
            continue
        for f in sorted(root.glob("*/*/*.gguf")):
            out.append(Found("lmstudio", _name(f.parent.name, f), f, f.stat().st_size))
    return out


def find_hf(root: Path | None = None) -> list[Found]:
    root = root or hf_root()
    out: list[Found] = []
    if not root.is_dir():
        return out
    for repo in sorted(root.glob("models--*")):
        parts = repo.name.split("--")
        if len(parts) < 3:
            continue
        snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
        if not snapshots:
            continue
        for f in sorted(snapshots[0].rglob("*.gguf")):  # the newest revision only
            blob = f.readlink().name if f.is_symlink() else ""  # ../../blobs/<sha256> for LFS files
            digest = f"sha256:{blob}" if re.fullmatch(r"[0-9a-f]{64}", blob) else None
            out.append(Found("hf", _name(parts[-1], f), f, f.stat().st_size, digest=digest))
    return out


def inspect(found: Found) -> Found:
    """Read the GGUF header: architecture and quantization, or why llama.cpp cannot use it."""
    if found.skip:
        return found
    if "mmproj" in found.path.name.lower():
        found.skip = "a vision projector (mmproj), not a language model"
        return found
    try:
        info = read_gguf(found.path)
    except Exception as e:
        found.skip = f"not a readable GGUF: {e}"
        return found
    found.arch, found.quantization = info.arch, info.quantization
    if info.arch in PROJECTOR_ARCHS:
        found.skip = f"a {info.arch} projector, not a language model"
    return found


def find_all(sources: tuple[str, ...] = ("ollama", "lmstudio", "hf")) -> list[Found]:
    finders: dict[str, Callable[[], list[Found]]] = {"ollama": find_ollama, "lmstudio": find_lmstudio,
                                                     "hf": find_hf}
    return [inspect(f) for s in sources for f in finders[s]()]
