"""The prefix store's files: an entry is only ever restored into the namespace that wrote it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from llmd.backends.llamacpp.prefix_store import MAC_BYTES, PrefixStore, StaleEntry, block_hashes

NS = "digest-abc|f16|chunk=4|fast|llama_cpp=0.3.36"
TOKENS = list(range(1, 13))
KEY = bytes(range(32))


def stored(tmp_path: Path, key: bytes = KEY) -> tuple[PrefixStore, str]:
    store = PrefixStore(tmp_path / "prefix", 1 << 20, key)
    hashes = block_hashes(NS, TOKENS, 4)
    return store, store.write(NS, TOKENS, hashes, b"kv state bytes")


def rewrite_header(store: PrefixStore, path: Path, **fields: object) -> None:
    """The entry's header changed and signed again, as this user's own llmd would have written it."""
    data = path.read_bytes()
    (hlen,) = struct.unpack_from("<Q", data, 8)
    header = {**json.loads(data[16:16 + hlen]), **fields}
    raw = json.dumps(header).encode()
    state = data[16 + hlen + MAC_BYTES:]
    path.write_bytes(data[:8] + struct.pack("<Q", len(raw)) + raw + store._mac(raw, state) + state)


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
    rewrite_header(store, store.path(entry), namespace=written_for)
    with pytest.raises(StaleEntry, match="written for"):
        store.read(entry, TOKENS[:8], NS)
    assert not store.path(entry).exists()
    assert store.lookup(block_hashes(NS, TOKENS, 4)) is None  # gone from the index too
    assert store.stats()["entries"] == 0


def _dropped(store: PrefixStore, entry: str) -> None:
    assert store.read(entry, TOKENS[:8], NS) is None
    assert not store.path(entry).exists() and store.lookup(block_hashes(NS, TOKENS, 4)) is None


def test_a_flipped_byte_in_the_state_is_dropped(tmp_path: Path):
    """As anyone who can write the cache folder could: a changed state byte, its old CRC32
    recomputed, was once restored into llama.cpp."""
    store, entry = stored(tmp_path)
    path = store.path(entry)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    _dropped(store, entry)


def test_a_changed_header_not_signed_again_is_dropped(tmp_path: Path):
    store, entry = stored(tmp_path)
    path = store.path(entry)
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"size": 14', b'"size": 15'))
    _dropped(store, entry)


@pytest.mark.parametrize("keep", [0, 8, 20, -MAC_BYTES - 14, -1])
def test_a_file_cut_short_is_dropped(tmp_path: Path, keep: int):
    store, entry = stored(tmp_path)
    path = store.path(entry)
    path.write_bytes(path.read_bytes()[:keep])
    _dropped(store, entry)


def test_an_entry_copied_from_another_users_cache_is_dropped(tmp_path: Path):
    theirs, entry = stored(tmp_path / "theirs", key=bytes(32))  # another user's llmd, its own key
    mine = PrefixStore(tmp_path / "prefix", 1 << 20, KEY)
    mine.write(NS, [99] * 4, block_hashes(NS, [99] * 4, 4), b"x")  # an index of its own
    mine.path(entry).write_bytes(theirs.path(entry).read_bytes())
    with mine.db.conn:  # indexed as if this llmd had written it
        for row in theirs.db.execute("select * from entries").fetchall():
            mine.db.conn.execute("insert into entries values (?, ?, ?, ?, ?, ?, ?)", list(row))
        for row in theirs.db.execute("select * from blocks").fetchall():
            mine.db.conn.execute("insert into blocks values (?, ?, ?)", list(row))
    _dropped(mine, entry)


def test_a_store_without_a_key_reads_and_writes_nothing(tmp_path: Path):
    store, entry = stored(tmp_path)
    keyless = PrefixStore(tmp_path / "prefix", 1 << 20)
    with pytest.raises(ValueError, match="no key"):
        keyless.write(NS, TOKENS, block_hashes(NS, TOKENS, 4), b"s")
    _dropped(keyless, entry)
