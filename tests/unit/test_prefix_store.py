"""The prefix store's files: an entry is only ever restored into the namespace that wrote it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from llmd.backends.llamacpp.prefix_store import PrefixStore, StaleEntry, block_hashes

NS = "digest-abc|f16|chunk=4|fast|llama_cpp=0.3.36"
TOKENS = list(range(1, 13))


def stored(tmp_path: Path) -> tuple[PrefixStore, str]:
    store = PrefixStore(tmp_path / "prefix", 1 << 20)
    hashes = block_hashes(NS, TOKENS, 4)
    return store, store.write(NS, TOKENS, hashes, b"kv state bytes")


def rewrite_header(path: Path, **fields: object) -> None:
    data = path.read_bytes()
    (hlen,) = struct.unpack_from("<Q", data, 8)
    header = {**json.loads(data[16:16 + hlen]), **fields}
    raw = json.dumps(header).encode()
    path.write_bytes(data[:8] + struct.pack("<Q", len(raw)) + raw + data[16 + hlen:])


def test_an_entry_reads_back_in_its_own_namespace(tmp_path: Path):
    store, entry = stored(tmp_path)
    assert store.read(entry, TOKENS[:8], NS) == (TOKENS, b"kv state bytes")


@pytest.mark.parametrize("written_for", [
    NS.replace("llama_cpp=0.3.36", "llama_cpp=0.3.16"),  # another llama.cpp build (state format 2 -> 3)
    NS.replace("digest-abc", "digest-def"),  # another model file
    None,  # an entry from before entries recorded what wrote them
])
def test_an_entry_written_by_another_build_or_model_is_dropped_never_restored(tmp_path: Path, written_for):
    store, entry = stored(tmp_path)
    rewrite_header(store.path(entry), namespace=written_for)
    with pytest.raises(StaleEntry, match="written for"):
        store.read(entry, TOKENS[:8], NS)
    assert not store.path(entry).exists()
    assert store.lookup(block_hashes(NS, TOKENS, 4)) is None  # gone from the index too
    assert store.stats()["entries"] == 0
