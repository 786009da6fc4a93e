"""Quantize a GGUF model with llama.cpp's own quantizer (`llama_model_quantize`).

Refused before any work when the type is unknown or the disk lacks room for the result.
Requantizing an already-quantized model is allowed (llama.cpp dequantizes first) with a
warning: it cannot gain back accuracy the source lost.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmd.errors import BadRequest
from llmd.models.gguf import read_gguf

# llama_ftype values and approximate bits per weight (for the disk check)
TYPES: dict[str, tuple[int, float]] = {
    "F16": (1, 16.0),
    "Q8_0": (7, 8.5),
    "Q5_K_M": (17, 5.7),
    "Q4_K_M": (15, 4.9),
    "Q4_0": (2, 4.5),
    "Q4_1": (3, 5.0),
}
UNQUANTIZED = ("F32", "F16", "BF16")


class QuantizeError(BadRequest):
    code = "quantize_failed"


@dataclass(frozen=True)
class Plan:
    src: Path
    dst: Path
    qtype: str
    expected_bytes: int
    warning: str | None


def plan(src: Path, dst: Path, qtype: str) -> Plan:
    qtype = qtype.upper()
    if qtype not in TYPES:
        raise QuantizeError(f"unknown quantization type {qtype!r}; use one of {', '.join(TYPES)}", "type")
    info = read_gguf(src)
    expected = int(info.n_params * TYPES[qtype][1] / 8) + info.data_offset
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst.parent).free
    if expected * 1.1 > free:
        raise QuantizeError(
            f"quantizing to {qtype} needs about {expected / 1e6:.0f} MB but {dst.parent} has {free / 1e6:.0f} MB "
            "free; free some space or pick a smaller type", "type")
    if dst.exists():
        raise QuantizeError(f"{dst} already exists; remove it or pick another --name", "name")
    warning = None
    if info.quantization not in UNQUANTIZED:
        warning = (f"{src.name} is already quantized ({info.quantization}); requantizing to {qtype} cannot "
                   "recover accuracy the source lost. Quantize from an F16/F32 original when you have one.")
    return Plan(src, dst, qtype, expected, warning)


def quantize(p: Plan, progress: Callable[[float], None] | None = None, threads: int = 0) -> Path:
    """Write p.dst atomically (temp name, rename); progress gets the fraction written so far."""
    import llama_cpp as L

    from llmd.backends.llamacpp.context import quiet_llama_log

    L.llama_backend_init()
    quiet_llama_log()
    params = L.llama_model_quantize_default_params()
    params.ftype = TYPES[p.qtype][0]
    params.allow_requantize = True
    params.nthread = threads or (os.cpu_count() or 1)
    tmp = p.dst.with_name(p.dst.name + ".partial")
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if progress is not None and tmp.exists():
                progress(min(0.99, tmp.stat().st_size / max(1, p.expected_bytes)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # llama.cpp writes a line per tensor it cannot quantize as asked straight to stderr; keep
    # them out of the terminal and report how many there were
    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            rc = L.llama_model_quantize(str(p.src).encode(), str(tmp).encode(), params)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            done.set()
            watcher.join()
        err.seek(0)
        fallbacks = sum(1 for line in err.read().decode(errors="replace").splitlines() if "falling back" in line)
    if fallbacks:
        logging.getLogger("llmd.quantize").warning(
            "%d tensors could not use %s (their rows are not a multiple of its block size) and used a "
            "nearby type instead", fallbacks, p.qtype)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise QuantizeError(f"llama.cpp could not quantize {p.src.name} to {p.qtype} (code {rc})", "type")
    read_gguf(tmp)  # the result must be a complete GGUF before it gets its name
    os.replace(tmp, p.dst)
    if progress is not None:
        progress(1.0)
    return p.dst
