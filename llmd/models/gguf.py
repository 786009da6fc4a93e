"""GGUF metadata without loading the model: arch, context, sizes, chat template, vocab.

A small reader of the GGUF header (gguf's GGUFReader takes ~12 s on a 49k-token vocab
because it materialises every array; this one skips arrays it does not need). It also
checks that every tensor's data lies inside the file, so a truncated download is refused
before llama.cpp ever sees it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmd.errors import BadRequest

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml tensor type -> (elements per block, bytes per block); checks that tensor data fits the file
_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
    22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
    29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}

FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}


class GGUFError(BadRequest):
    code = "invalid_model_file"


ENCODER_ARCHS = ("bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "neo-bert", "modern-bert", "t5encoder")


@dataclass
class GGUFInfo:
    path: Path
    version: int
    metadata: dict[str, Any]
    n_params: int
    file_size: int
    data_offset: int
    tensor_types: dict[int, int] = field(default_factory=dict)  # ggml type -> count

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    @property
    def context_length(self) -> int:
        return int(self.arch_value("context_length", 0) or 0)

    @property
    def quantization(self) -> str:
        ft = self.metadata.get("general.file_type")
        return FILE_TYPES.get(int(ft), f"type{ft}") if ft is not None else "unknown"

    @property
    def chat_template(self) -> str | None:
        t = self.metadata.get("tokenizer.chat_template")
        return str(t) if t else None

    @property
    def embedding_only(self) -> bool:
        """An embedding model (BERT-like encoders; or a model that declares its pooling and has no
        chat template), as Ollama tells them apart: it embeds, it does not chat."""
        return self.arch in ENCODER_ARCHS or (self.arch_value("pooling_type") is not None and not self.chat_template)

    @property
    def n_layer(self) -> int:
        return int(self.arch_value("block_count", 0) or 0)

    @property
    def n_head(self) -> int:
        return int(self.arch_value("attention.head_count", 0) or 0)

    @property
    def n_head_kv(self) -> int:
        kv = self.arch_value("attention.head_count_kv")
        return int(kv) if kv is not None else self.n_head

    @property
    def n_embd(self) -> int:
        return int(self.arch_value("embedding_length", 0) or 0)

    @property
    def head_dim_k(self) -> int:
        k = self.arch_value("attention.key_length")
        return int(k) if k else (self.n_embd // self.n_head if self.n_head else 0)

    @property
    def head_dim_v(self) -> int:
        v = self.arch_value("attention.value_length")
        return int(v) if v else self.head_dim_k

    def kv_bytes_per_token(self, bytes_per_elem: float = 2.0) -> int:
        """KV cache bytes one token takes in every layer (f16 K and V by default)."""
        return int(self.n_layer * self.n_head_kv * (self.head_dim_k + self.head_dim_v) * bytes_per_elem)

    def summary(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "name": self.metadata.get("general.name"),
            "n_params": self.n_params,
            "quantization": self.quantization,
            "context_length": self.context_length,
            "has_chat_template": self.chat_template is not None,
            "file_size": self.file_size,
            "n_layer": self.n_layer,
            "n_head_kv": self.n_head_kv,
            "n_embd": self.n_embd,
            "vocab_size": self.metadata.get("tokenizer.ggml.tokens"),  # arrays are kept as their length
        }


class _Cursor:
    def __init__(self, buf: Any, size: int, path: Path) -> None:
        self.buf, self.size, self.off, self.path = buf, size, 0, path

    def need(self, n: int) -> None:
        if self.off + n > self.size:
            raise GGUFError(
                f"{self.path} ends at byte {self.size} inside its GGUF header (needed {self.off + n}): "
                "the file is truncated; download or copy it again"
            )

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += n
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n)
        raw = bytes(self.buf[self.off : self.off + n])
        self.off += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")
        self.need(n)
        self.off += n

    def value(self, vtype: int, keep: bool = True) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype = self.unpack("<I")
            count = self.unpack("<Q")
            if keep:
                return [self.value(itype) for _ in range(count)]
            if itype in _SCALARS:
                size = struct.calcsize(_SCALARS[itype]) * count
                self.need(size)
                self.off += size
            elif itype == _STRING:  # token and merge lists: hot, so inline
                buf, off, unpack, size = self.buf, self.off, struct.unpack_from, self.size
                for _ in range(count):
                    if off + 8 > size:
                        self.off = off
                        self.need(8)
                    off += 8 + unpack("<Q", buf, off)[0]
                self.off = off
                self.need(0)
            else:
                for _ in range(count):
                    self.value(itype, keep=False)
            return count
        raise GGUFError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.off}; not a GGUF file llmd can read")


def read_gguf(path: str | Path, arrays: tuple[str, ...] = ()) -> GGUFInfo:
    """Parse the header of a GGUF file. Raises GGUFError with what is wrong and what to do.
    Arrays are skipped (counted) except general.* ones and the keys named in `arrays`."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path} does not exist or is not a file")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path} is {size} bytes: too small to be a GGUF model")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (it starts with {bytes(buf[:4])!r}, not b'GGUF')")
        c = _Cursor(buf, size, path)
        c.off = 4
        version = c.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path} is GGUF version {version}; llmd reads versions 2 and 3")
        n_tensors = c.unpack("<Q")
        n_kv = c.unpack("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            vtype = c.unpack("<I")
            keep = vtype != _ARRAY or key.startswith("general.") or key in arrays
            meta[key] = c.value(vtype, keep=keep)
        n_params = 0
        end_of_data = 0
        types: dict[int, int] = {}
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.unpack("<I")
            dims = [c.unpack("<Q") for _ in range(n_dims)]
            ttype = c.unpack("<I")
            offset = c.unpack("<Q")
            n_el = 1
            for d in dims:
                n_el *= d
            n_params += n_el
            types[ttype] = types.get(ttype, 0) + 1
            block, type_size = _BLOCKS.get(ttype, (1, 0))
            end_of_data = max(end_of_data, offset + n_el // block * type_size)
            del name
        align = int(meta.get("general.alignment", 32))
        data_offset = (c.off + align - 1) // align * align
    if data_offset + end_of_data > size:
        raise GGUFError(
            f"{path} is {size} bytes but its tensors need {data_offset + end_of_data}: "
            "the file is truncated; download or copy it again"
        )
    return GGUFInfo(path, version, meta, n_params, size, data_offset, types)
