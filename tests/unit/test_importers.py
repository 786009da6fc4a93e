"""Finding models other tools downloaded (real store layouts, with the packaged GGUF as the
model file) and `llmd models import` registering them in place."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from llmd.models.catalog import find_packaged
from llmd.models.importers import find_all, find_hf, find_lmstudio, find_ollama, inspect

GGUF = find_packaged()["smollm2-135m"]


def _ollama_store(root: Path) -> str:
    digest = "sha256:" + "ab" * 32
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    shutil.copyfile(GGUF, blobs / digest.replace(":", "-"))  # a copy: the packaged file is registered already
    params = "sha256:" + "cd" * 32
    (blobs / params.replace(":", "-")).write_text(json.dumps({"stop": ["<|im_end|>"], "temperature": 0.2}))
    manifest = {"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": GGUF.stat().st_size},
        {"mediaType": "application/vnd.ollama.image.params", "digest": params, "size": 10},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "ef" * 32, "size": 5}]}
    for rel in ("registry.ollama.ai/library/smollm2/135m", "hf.co/bartowski/SmolLM2-GGUF/Q4_1"):
        m = root / "manifests" / rel
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(json.dumps(manifest))
    return digest


def test_ollama_manifests(tmp_path: Path):
    digest = _ollama_store(tmp_path)
    found = {f.name: f for f in find_ollama(tmp_path)}
    assert set(found) == {"smollm2:135m", "hf.co/bartowski/SmolLM2-GGUF:Q4_1"}
    f = inspect(found["smollm2:135m"])
    assert f.digest == digest and f.skip is None and f.arch == "llama" and f.quantization == "Q4_1"
    assert f.defaults["params"]["temperature"] == 0.2


def test_lmstudio_and_hf_cache(tmp_path: Path):
    lms = tmp_path / "lms"
    (lms / "bartowski" / "SmolLM2-135M-Instruct-GGUF").mkdir(parents=True)
    (lms / "bartowski" / "SmolLM2-135M-Instruct-GGUF" / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(GGUF)
    (lms / "bartowski" / "SmolLM2-135M-Instruct-GGUF" / "mmproj-f16.gguf").write_bytes(b"GGUF")
    found = [inspect(f) for f in find_lmstudio([lms])]
    by_file = {f.path.name: f for f in found}
    model = by_file["SmolLM2-135M-Instruct-Q4_1.gguf"]
    assert model.name == "smollm2-135m-instruct:q4_1" and model.skip is None
    assert "projector" in (by_file["mmproj-f16.gguf"].skip or "")

    hub = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF"
    sha = hashlib.sha256(b"x").hexdigest()
    (hub / "blobs").mkdir(parents=True)
    (hub / "blobs" / sha).symlink_to(GGUF)
    snap = hub / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (snap / "smollm2-135m-instruct-q4_1.gguf").symlink_to(hub / "blobs" / sha)
    [f] = find_hf(tmp_path / "hub")
    assert f.name == "smollm2-135m-instruct:q4_1" and f.digest == f"sha256:{sha}"


def test_models_import_registers_in_place_and_rm_keeps_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]):
    from llmd.cli import main
    from llmd.config import load_settings
    from llmd.models.registry import Registry

    _ollama_store(tmp_path / "ollama")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    assert main(["models", "import", "--from", "ollama", "--dry-run"]) == 0
    assert "would import" in capsys.readouterr().out
    assert main(["models", "import", "--from", "ollama", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["smollm2:135m"]["status"] == "imported"
    s = load_settings({})
    reg = Registry(s.paths.registry_db, s.paths.models_dir)
    row = reg.get("smollm2:135m")
    assert row["source"] == "ollama" and row["digest"] == "sha256:" + "ab" * 32
    assert main(["models", "import", "--from", "ollama", "--json"]) == 0
    again = {r["name"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert again["smollm2:135m"].startswith("already registered")
    reg.remove("smollm2:135m")
    assert os.path.exists(row["path"])  # another tool's file: unregistered, never deleted
    assert all(f.name != "x" for f in find_all(("lmstudio",)))
