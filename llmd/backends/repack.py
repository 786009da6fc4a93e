"""Whether llama.cpp may repack weights on this CPU, and the record of where it crashed.

llama.cpp's CPU backend repacks quantized weights into "extra buffer types" (AMX tiles on
Intel Xeons, interleaved layouts elsewhere) for faster matrix products. On some CPUs those
kernels crash (measured: AMX repacking segfaults at the first decode of more than one token).
A crash kills the process, so it cannot be caught; the daemon watches the worker die while
loading, loads again without repacking, and writes the crash here so that every later load on
this machine, llama.cpp build and model file type goes without it directly.

The record is one small JSON file in the data dir, keyed by those three things; LLMD_REPACK
(auto | on | off) overrides it. Nothing here imports llama_cpp.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmd.backends.select import cpu_identity

log = logging.getLogger("llmd.repack")

REPACK_MODES = ("auto", "on", "off")


def llama_cpp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return "unknown"


def repack_kind(flags: tuple[str, ...] | None = None) -> str:
    """What llama.cpp repacks for on this CPU, for messages: "AMX" where the CPU has it."""
    flags = cpu_identity()[1] if flags is None else flags
    return "AMX" if any(f.startswith("amx") for f in flags) else "CPU"


@dataclass(frozen=True)
class Decision:
    repack: bool
    reason: str
    recorded: dict[str, Any] | None = None  # the crash record behind an automatic "off"

    def as_dict(self) -> dict[str, Any]:
        return {"repack": self.repack, "reason": self.reason, "recorded": self.recorded}


class RepackRecord:
    """The crashes seen on this machine: {key: {cpu, llama_cpp, file_type, when, reason}}."""

    def __init__(self, path: Path) -> None:
        self.path = path
        cpu, flags = cpu_identity()
        self.cpu = cpu
        self.kind = repack_kind(flags)
        self.build = llama_cpp_version()
        self._machine = hashlib.sha256("\n".join([cpu, " ".join(flags), self.build]).encode()).hexdigest()[:16]

    def key(self, file_type: str) -> str:
        return f"{self._machine}:{file_type}"

    def entries(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:  # a damaged record only costs one more crash at load
            log.warning("repack record %s unreadable (%s); ignoring it", self.path, e)
            return {}
        return data if isinstance(data, dict) else {}

    def crashed(self, file_type: str) -> dict[str, Any] | None:
        entry = self.entries().get(self.key(file_type))
        return entry if isinstance(entry, dict) else None

    def here(self) -> list[dict[str, Any]]:
        """The records for this CPU and llama.cpp build (others are kept, but do not apply)."""
        return [e for k, e in self.entries().items() if k.startswith(self._machine + ":") and isinstance(e, dict)]

    def write_crash(self, file_type: str, model: str, how: str) -> dict[str, Any]:
        entry = {
            "cpu": self.cpu, "llama_cpp": self.build, "file_type": file_type, "model": model,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "reason": f"weight repacking ({self.kind}) crashed on this CPU at load ({how}); running without it",
        }
        data = self.entries()
        data[self.key(file_type)] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
        return entry

    def decide(self, mode: str, file_types: tuple[str, ...]) -> Decision:
        """Repack or not for a load of models of these file types (a target and its draft)."""
        if mode == "on":
            return Decision(True, "LLMD_REPACK=on")
        if mode == "off":
            return Decision(False, "LLMD_REPACK=off")
        for ft in file_types:
            entry = self.crashed(ft)
            if entry is not None:
                return Decision(False, str(entry.get("reason", "repacking crashed here before")), entry)
        return Decision(True, f"auto: on (no crash recorded for {'/'.join(file_types)} on this CPU)")


def decide_for_files(mode: str, record: RepackRecord, paths: list[str], name: str) -> Decision:
    """The decision for a command that runs these GGUFs in its own process (`llmd eval`): with
    nothing recorded, a trial load in a child process finds a crashing kernel first."""
    from llmd.backends.llamacpp.trial import crash_signal
    from llmd.models.gguf import read_gguf

    file_types = tuple(read_gguf(p).quantization for p in paths)
    decision = record.decide(mode, file_types)
    if not decision.repack or mode != "auto":
        return decision
    sig = crash_signal(paths)
    if not sig:
        return decision
    entries = [record.write_crash(ft, name, f"killed by signal {sig}") for ft in file_types]
    log.warning("%s (recorded in %s)", entries[0]["reason"], record.path)
    return Decision(False, entries[0]["reason"], entries[0])


def repack_for(paths: list[str], name: str = "") -> bool:
    """Repack or not, for code that runs these GGUFs in its own process (benchmarks, tests): the
    user's LLMD_REPACK and record, with a trial load when nothing is known."""
    from llmd.config import load_settings

    settings = load_settings()
    record = RepackRecord(settings.paths.repack_record)
    return decide_for_files(settings.repack, record, paths, name or Path(paths[0]).stem).repack
