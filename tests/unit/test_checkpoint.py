"""Model folders in the registry: Hugging Face checkpoints and TensorRT-LLM engines."""

import json
from pathlib import Path

import pytest
from conftest import hf_folder

from llmd.backends.select import ModelFormats, choose, formats_of, probe
from llmd.models.catalog import find_packaged
from llmd.models.checkpoint import CheckpointError, read_checkpoint
from llmd.models.registry import Registry


def test_reads_a_hf_checkpoint_without_reading_weights(tmp_path: Path):
    ck = read_checkpoint(hf_folder(tmp_path / "hf"))
    assert (ck.format, ck.arch, ck.n_params, ck.context_length, ck.quantization) == ("hf", "llama", 40, 8192, "FP8")
    assert ck.has_chat_template and ck.digest.startswith("sha256:")


def test_engine_folder_and_bad_folders(tmp_path: Path):
    eng = tmp_path / "eng"
    eng.mkdir()
    (eng / "config.json").write_text(json.dumps({"pretrained_config": {"architecture": "LlamaForCausalLM"}}))
    (eng / "rank0.engine").write_bytes(b"\0" * 10)
    assert read_checkpoint(eng).format == "engine"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        read_checkpoint(empty)
    (empty / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        read_checkpoint(empty)


def test_registry_attaches_a_checkpoint_to_a_gguf_model(tmp_path: Path):
    reg = Registry(tmp_path / "registry.db", tmp_path / "models")
    reg.add(find_packaged()["smollm2-135m"], "smol")
    row = reg.add(hf_folder(tmp_path / "hf"), "smol")  # same name: attach
    assert row["format"] == "gguf" and row["hf_path"] == str(tmp_path / "hf")
    f = formats_of(row, 1024, 1)
    assert f.gguf and f.hf_checkpoint and f.n_layer == 30
    only = reg.add(tmp_path / "hf", "smol-hf")
    assert only["format"] == "hf" and only["n_params"] == 40
    assert formats_of(only, 1024, 1) == ModelFormats(gguf=False, hf_checkpoint=True, trt_engine=False)


def test_a_checkpoint_only_model_cannot_run_without_tensorrt(tmp_path: Path):
    c = choose(probe(), ModelFormats(gguf=False, hf_checkpoint=True))
    if c.backend != "tensorrt":
        assert c.backend == "none" and "add a GGUF" in c.reason
