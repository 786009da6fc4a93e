"""Model folders beside GGUF files: a Hugging Face checkpoint (config.json + *.safetensors), which
TensorRT-LLM builds from or loads pre-quantized, or a built TensorRT-LLM engine (*.engine).

Reads only small files: config.json, tokenizer_config.json and each safetensors header (the
weights themselves are never read, so registering a multi-GB checkpoint is instant).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmd.errors import BadRequest

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


class CheckpointError(BadRequest):
    code = "invalid_model_folder"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    format: str  # "hf" | "engine"
    arch: str
    n_params: int
    context_length: int
    quantization: str
    has_chat_template: bool
    size: int
    digest: str

    def row(self) -> dict[str, Any]:
        return {"format": self.format, "arch": self.arch, "n_params": self.n_params,
                "context_length": self.context_length, "quantization": self.quantization,
                "has_chat_template": int(self.has_chat_template), "size": self.size, "digest": self.digest}


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON: {e}") from None


def read_checkpoint(folder: Path) -> Checkpoint:
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json: a model folder must be a Hugging Face checkpoint "
                              "(config.json + *.safetensors) or a TensorRT-LLM engine (config.json + *.engine)")
    cfg = _json(folder / "config.json")
    engines = sorted(folder.glob("*.engine"))
    shards = sorted(folder.glob("*.safetensors"))
    if not engines and not shards:
        raise CheckpointError(f"{folder} has config.json but no *.safetensors weights and no *.engine files")
    h = hashlib.sha256(b"llmd-folder-v1")
    h.update((folder / "config.json").read_bytes())
    n_params = 0
    for shard in shards:
        with shard.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{shard} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            header = f.read(n)
        if len(header) < n:
            raise CheckpointError(f"{shard} is truncated inside its header")
        h.update(header)
        for name, t in json.loads(header).items():
            if name != "__metadata__":
                count = 1
                for d in t["shape"]:
                    count *= d
                n_params += count
    files = engines + shards
    size = sum(p.stat().st_size for p in files)
    for p in engines:
        h.update(p.name.encode() + str(p.stat().st_size).encode())
    pretrained = cfg.get("pretrained_config", cfg)  # engine configs nest the model's config
    qc = cfg.get("quantization_config") or pretrained.get("quantization") or {}
    quant = str(qc.get("quant_method") or qc.get("quant_algo") or pretrained.get("torch_dtype")
                or pretrained.get("dtype") or "unknown").upper()
    tok = folder / "tokenizer_config.json"
    return Checkpoint(
        path=folder, format="engine" if engines else "hf",
        arch=str(pretrained.get("model_type") or pretrained.get("architecture")
                 or (pretrained.get("architectures") or ["unknown"])[0]),
        n_params=n_params, context_length=int(pretrained.get("max_position_embeddings") or 0),
        quantization=quant, has_chat_template=tok.is_file() and "chat_template" in _json(tok), size=size,
        digest="sha256:" + h.hexdigest(),
    )


def chat_template(folder: Path) -> str | None:
    """The chat template a Hugging Face checkpoint's tokenizer_config.json carries, if any."""
    try:
        template = _json(folder / "tokenizer_config.json").get("chat_template")
    except CheckpointError:
        return None
    return template if isinstance(template, str) else None
