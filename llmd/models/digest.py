"""A model file's digest: the registry records it, and a pull checks what it downloaded against it."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_digest(path: Path) -> str:
    """'sha256:' and the hex SHA-256 of the file's bytes, read a MiB at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
