"""Split a GGUF into llama.cpp's `-0000i-of-0000N.gguf` parts (for pull tests), with gguf-py's
own writer: every key in the first part, the tensors spread over `parts` files."""

from __future__ import annotations

import math
from pathlib import Path

import gguf


def split(src: Path, dest_stem: Path, parts: int) -> list[Path]:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    per = math.ceil(len(reader.tensors) / parts)
    writer = gguf.GGUFWriter(dest_stem.with_suffix(".gguf"), arch, split_max_tensors=per)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return sorted(dest_stem.parent.glob(dest_stem.name + "-*-of-*.gguf"))
