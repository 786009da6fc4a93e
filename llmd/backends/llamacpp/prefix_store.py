"""The files and index of the on-disk prompt-prefix KV cache (prefix_cache.py decides what to
store and restore): survives restarts, unloads and model switches.

Prompts are cut into blocks of `chunk` tokens; block i's key is a hash chain over a namespace
(model digest, KV settings, batching policy, llama.cpp version) and the tokens of blocks 0..i.
An entry is one sequence's KV state (`llama_state_seq_get_data`) with its tokens; the SQLite
index maps every whole block the entry covers to it, so a new prompt finds its deepest stored
block with one query.

Files are written atomically (temp file, fsync, rename) and carry their tokens, their namespace
and an HMAC-SHA256 over both and the state, keyed by a secret in the config folder (0600): the
cache folder is input, and llama.cpp's state loader has had heap overflows on crafted files, so
nothing that anyone who can write this folder wrote reaches it. An entry that fails the MAC (a
flipped byte, a cut file, an entry from another user's cache), any other check, or llama.cpp's
own load is dropped, counted and logged, never used. The namespace in the file is checked again at read, so an entry written by
another llama.cpp build (whose saved-state format may differ: llama.cpp bumped it in 2025) or
for another model file is never fed to this one, whatever the index says.
Least recently used entries go first when the size bound is passed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from llmd.db import open_cache_db

log = logging.getLogger("llmd.prefix_cache")
MAGIC = b"LLMDKV2\n"  # 2: an HMAC instead of a CRC32 (older entries are dropped as unreadable)
MAC_BYTES = 32
T = TypeVar("T")
SLOW_READ_ENV = "LLMD_TEST_SLOW_PREFIX_READ"  # test-only: seconds each disk read waits first


def _m001_index(db: sqlite_utils.Database) -> None:
    db.table("entries").create({"id": str, "namespace": str, "n_tokens": int, "size": int, "created_at": float,
                          "last_used": float, "hits": int}, pk="id")
    db.table("entries").create_index(["last_used"])
    db.table("blocks").create({"hash": str, "entry": str, "depth": int}, pk="hash")
    db.table("blocks").create_index(["entry"])


MIGRATIONS = [("001_index", _m001_index)]


def namespace(model_digest: str, chunk: int, policy: str, kv_type: str = "f16") -> str:
    """Entries of the exact policy hold prefill-computed KV only; the fast policy's may hold
    decode-time KV too, so the two never share entries."""
    import llama_cpp

    return f"{model_digest}|{kv_type}|chunk={chunk}|{policy}|llama_cpp={llama_cpp.__version__}"


def block_hashes(ns: str, tokens: list[int], chunk: int) -> list[str]:
    """Hash chain over whole blocks: hashes[i] covers tokens[: (i + 1) * chunk]."""
    out = []
    h = hashlib.sha256(ns.encode()).digest()
    for start in range(0, len(tokens) - len(tokens) % chunk, chunk):
        h = hashlib.sha256(h + struct.pack(f"<{chunk}i", *tokens[start:start + chunk])).digest()
        out.append(h.hex())
    return out


class StaleEntry(Exception):
    """An entry written for another namespace (llama.cpp build, model file, KV settings): dropped."""


@dataclass(frozen=True)
class Match:
    entry: str
    depth: int  # whole blocks of the prompt this entry covers


class PrefixStore:
    """The index and the files. One instance per thread (each has its own SQLite connection)."""

    def __init__(self, root: Path, max_bytes: int, key: bytes = b"", sweep: bool = False) -> None:
        """`key`: the HMAC key; a store without one can list, clear and sweep, not read or write."""
        self.root = root
        self._key = key
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        self.db = open_cache_db(root / "index.db", MIGRATIONS)
        self.max_bytes = max_bytes
        if sweep:
            self.sweep()

    def sweep(self) -> None:
        """Remove what a crash can leave behind: temp files, and entry files the index does not know."""
        known = {r[0] for r in self.db.execute("select id from entries").fetchall()}
        removed = 0
        for f in self.root.iterdir():
            if ".tmp" in f.name or (f.suffix == ".kv" and f.stem not in known):
                f.unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("prefix cache: removed %d files left by an earlier crash", removed)

    def path(self, entry: str) -> Path:
        return self.root / f"{entry}.kv"

    def lookup(self, hashes: list[str]) -> Match | None:
        if not hashes:
            return None
        marks = ",".join("?" * len(hashes))
        row = self.db.execute(
            f"select entry, depth from blocks where hash in ({marks}) order by depth desc limit 1", hashes).fetchone()
        return Match(row[0], row[1]) if row else None

    def has(self, block_hash: str) -> bool:
        return self.db.execute("select 1 from blocks where hash = ?", [block_hash]).fetchone() is not None

    def read(self, entry: str, expect: list[int], ns: str) -> tuple[list[int], bytes] | None:
        """(tokens, state bytes) of an entry of namespace `ns` whose tokens start with `expect`, or
        None (dropped). Every header field is checked; any failure while reading drops the entry;
        one written for another namespace is dropped and raises StaleEntry (counted apart)."""
        path = self.path(entry)
        stale = ""
        try:
            if not self._key:
                raise ValueError("no key to check it with")
            data = path.read_bytes()
            if data[:8] != MAGIC:
                raise ValueError("bad magic")
            (hlen,) = struct.unpack_from("<Q", data, 8)
            if hlen > len(data) - 16 - MAC_BYTES:
                raise ValueError(f"header length {hlen} runs past the file ({len(data)} bytes)")
            head, mac, state = data[16:16 + hlen], data[16 + hlen:16 + hlen + MAC_BYTES], data[16 + hlen + MAC_BYTES:]
            if not hmac.compare_digest(mac, self._mac(head, state)):  # before anything in it is believed
                raise ValueError("its signature does not match (changed, cut short, or not written by this user's llmd)")
            header = json.loads(head)
            if not isinstance(header, dict):
                raise ValueError("header is not an object")
            tokens = header.get("tokens")
            if not (isinstance(tokens, list) and all(type(t) is int and t >= 0 for t in tokens)):
                raise ValueError("tokens is not a list of token ids")
            if header.get("n_tokens") != len(tokens) or not tokens:
                raise ValueError("n_tokens does not match the tokens")
            if header.get("size") != len(state):
                raise ValueError(f"payload is {len(state)} bytes, header says {header.get('size')}")
            if tokens[: len(expect)] != expect:
                raise ValueError("tokens do not match the index")
            if header.get("namespace") != ns:
                stale = f"it was written for {header.get('namespace')!r}, this model is {ns!r}"
                raise ValueError(stale)
        except Exception as e:  # anything wrong with an entry costs only the entry
            log.warning("prefix cache: dropping entry %s: %s", entry, e)
            self.drop(entry)
            if stale:
                raise StaleEntry(stale) from None
            return None
        with self.db.conn:
            self.db.conn.execute("update entries set last_used = ?, hits = hits + 1 where id = ?", [time.time(), entry])
        return list(tokens), state

    def write(self, ns: str, tokens: list[int], hashes: list[str], state: bytes) -> str:
        if not self._key:
            raise ValueError("the prefix store has no key to sign entries with")
        entry = hashes[-1][:32]
        header = json.dumps({"n_tokens": len(tokens), "tokens": tokens, "size": len(state), "namespace": ns}).encode()
        path = self.path(entry)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        # 0600: an entry holds the prompt's token ids, which decode back to the prompt
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header + self._mac(header, state))
            f.write(state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        now = time.time()
        size = path.stat().st_size
        with self.db.conn:
            self.db.conn.execute("insert or replace into entries values (?, ?, ?, ?, ?, ?, 0)",
                                 [entry, ns, len(tokens), size, now, now])
            self.db.conn.executemany("insert or replace into blocks values (?, ?, ?)",
                                     [(h, entry, i + 1) for i, h in enumerate(hashes)])
        self.evict()
        return entry

    def _mac(self, header: bytes, state: bytes) -> bytes:
        m = hmac.new(self._key, MAGIC + struct.pack("<Q", len(header)) + header, hashlib.sha256)
        m.update(state)
        return m.digest()

    def drop(self, entry: str) -> None:
        with self.db.conn:
            self.db.conn.execute("delete from blocks where entry = ?", [entry])
            self.db.conn.execute("delete from entries where id = ?", [entry])
        self.path(entry).unlink(missing_ok=True)

    def evict(self) -> None:
        total = self.db.execute("select coalesce(sum(size), 0) from entries").fetchone()[0]
        if total <= self.max_bytes:
            return
        for entry, size in self.db.execute("select id, size from entries order by last_used").fetchall():
            self.drop(entry)
            total -= size
            if total <= self.max_bytes:
                break

    def stats(self) -> dict[str, Any]:
        n, size = self.db.execute("select count(*), coalesce(sum(size), 0) from entries").fetchone()
        hits = self.db.execute("select coalesce(sum(hits), 0) from entries").fetchone()[0]
        return {"entries": n, "bytes": size, "max_bytes": self.max_bytes, "entry_hits": hits}

    def clear(self, ns: str | None = None, keep: Collection[str] = ()) -> int:
        """Drop the entries of namespace `ns` (all but those of `keep` when None; then also files the
        index does not know). A worker clears its own namespace; the daemon the rest."""
        if ns is not None:
            rows = self.db.execute("select id from entries where namespace = ?", [ns]).fetchall()
        else:
            rows = [r for r in self.db.execute("select id, namespace from entries").fetchall() if r[1] not in keep]
        for r in rows:
            self.drop(r[0])
        if ns is None and not keep:  # no worker is writing: files the index does not know are strays
            known = {r[0] for r in self.db.execute("select id from entries").fetchall()}
            for stray in self.root.glob("*.kv"):
                if stray.stem not in known:
                    stray.unlink(missing_ok=True)
        return len(rows)


class PrefixWriter:
    """Writes entries on a background thread so saving never delays a reply or a step."""

    def __init__(self, root: Path, max_bytes: int, key: bytes) -> None:
        self._root, self._max, self._key = root, max_bytes, key
        self._jobs: list[tuple[str, list[int], list[str], bytes]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._writing = False
        self.saved = 0
        self._thread = threading.Thread(target=self._run, name="llmd-prefix-writer", daemon=True)
        self._thread.start()

    MAX_PENDING_BYTES = 512 * 1024 * 1024  # snapshots waiting for the disk; beyond it the oldest is skipped

    def submit(self, ns: str, tokens: list[int], hashes: list[str], state: bytes) -> None:
        with self._cv:
            self._jobs.append((ns, tokens, hashes, state))
            pending = sum(len(j[3]) for j in self._jobs)
            while pending > self.MAX_PENDING_BYTES and len(self._jobs) > 1:
                skipped = self._jobs.pop(0)
                pending -= len(skipped[3])
                log.warning("prefix cache: the disk is behind; not saving a %d-token prefix (%d bytes) to keep "
                            "memory bounded", len(skipped[1]), len(skipped[3]))
            self._cv.notify()

    @property
    def busy(self) -> bool:
        """Snapshots queued or being written (its disk and CPU use are llmd's idle work too)."""
        return bool(self._jobs) or self._writing

    def discard(self) -> None:
        """Drop the snapshots not written yet and wait for the one being written (a clear follows)."""
        with self._cv:
            self._jobs.clear()
        while self._writing:
            time.sleep(0.01)

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        # normal priority, though it is idle work: in SCHED_IDLE it got no CPU while an agent's turns
        # kept the cores busy, and 11,800-token snapshots (340 MB) were skipped as "the disk is behind";
        # copying to the page cache is a small part of a snapshot's cost (the state copy runs at nice 19)
        store = PrefixStore(self._root, self._max, self._key)
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.pop(0)
                self._writing = True
            try:
                store.write(*job)
                self.saved += 1
            except Exception:
                log.exception("prefix cache: could not save an entry")
            finally:
                self._writing = False


class PrefixReader:
    """Reads entries on a background thread: an entry can be hundreds of MB, and reading it on the
    step thread would hold every other stream for as long as the disk takes."""

    def __init__(self, root: Path, max_bytes: int, key: bytes) -> None:
        self._root, self._max, self._key = root, max_bytes, key
        self._store: PrefixStore | None = None  # made on the reader thread (its own connection)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmd-prefix-reader")
        self._delay = float(os.environ.get(SLOW_READ_ENV) or 0)

    def run(self, fn: Callable[[PrefixStore], T]) -> Future[T]:
        return self._pool.submit(self._call, fn)

    def _call(self, fn: Callable[[PrefixStore], T]) -> T:
        if self._delay:
            time.sleep(self._delay)
        if self._store is None:
            self._store = PrefixStore(self._root, self._max, self._key)
        return fn(self._store)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
