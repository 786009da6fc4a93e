"""Responses kept for the Responses API: `previous_response_id` continues a stored conversation,
and GET / DELETE /v1/responses/{id} read and remove one.

A stored response keeps the conversation that led to it (as chat messages) and its reply (the
Response object), so a follow-up rebuilds the whole history without the client resending it.
Kept 30 days, like OpenAI's, in DATA/responses_api.db, and at most LLMD_RESPONSES_STORE_MB: past
it, the oldest go first, as each new one is stored (an agent storing every turn of long sessions
must not fill the disk). A damaged file is moved aside and rebuilt (a follow-up then gets a 404
naming the id, never a 500).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import sqlite_utils

from llmd.db import open_cache_db

KEEP_S = 30 * 24 * 3600
EXPIRE_EVERY_S = 3600.0  # how often a put also removes what is past KEEP_S
SIZE = "length(messages) + length(response)"


def _m001_stored(db: sqlite_utils.Database) -> None:
    db.table("stored").create({"id": str, "model": str, "messages": str, "response": str, "created_at": float},
                              pk="id")
    db.table("stored").create_index(["created_at"])


MIGRATIONS = [("001_stored", _m001_stored)]


class StoredResponses:
    def __init__(self, path: Path, max_bytes: int = 256 * 2**20) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.db = open_cache_db(path, MIGRATIONS)
        self.pruned = 0  # removed for room (not for age) since the start
        self._bytes = 0  # the size of what is stored (its characters), counted once here, then kept up
        with self._lock:
            self._expire()
            self._bytes = int(self.db.execute(f"select coalesce(sum({SIZE}), 0) from stored").fetchone()[0])

    def put(self, rid: str, model: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        msgs, resp = json.dumps(messages, ensure_ascii=False), json.dumps(response, ensure_ascii=False)
        row = {"id": rid, "model": model, "messages": msgs, "response": resp, "created_at": time.time()}
        with self._lock:
            old = self.db.execute(f"select {SIZE} from stored where id = ?", [rid]).fetchone()
            self.db.table("stored").upsert(row, pk="id")
            self._bytes += len(msgs) + len(resp) - (old[0] if old else 0)
            if time.monotonic() - self._expired >= EXPIRE_EVERY_S:
                self._expire()
            if self._bytes > self.max_bytes:
                self._prune(keep=rid)

    def stats(self) -> dict[str, int]:
        with self._lock:
            n = self.db.execute("select count(*) from stored").fetchone()[0]
        return {"stored": n, "bytes": self._bytes, "max_bytes": self.max_bytes, "pruned": self.pruned}

    def _expire(self) -> None:
        cutoff = time.time() - KEEP_S
        with self.db.conn:  # no DELETE ... RETURNING: it needs SQLite 3.35, and Debian 11 has 3.34
            gone = self.db.conn.execute(f"select {SIZE} from stored where created_at < ?", [cutoff]).fetchall()
            self.db.conn.execute("delete from stored where created_at < ?", [cutoff])
        self._bytes -= sum(r[0] for r in gone)
        self._expired = time.monotonic()

    def _prune(self, keep: str) -> None:
        """The oldest first, down to 90% of the bound (so not every put prunes); never `keep`."""
        target = int(self.max_bytes * 0.9)
        rows = self.db.execute(f"select id, {SIZE} from stored where id != ? order by created_at", [keep]).fetchall()
        drop = []
        for rid, size in rows:
            if self._bytes <= target:
                break
            drop.append(rid)
            self._bytes -= size
        with self.db.conn:
            self.db.conn.executemany("delete from stored where id = ?", [(r,) for r in drop])
        self.pruned += len(drop)

    def get(self, rid: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        with self._lock:
            rows = list(self.db.query("select messages, response from stored where id = ?", [rid]))
        if not rows:
            return None
        return json.loads(rows[0]["messages"]), json.loads(rows[0]["response"])

    def delete(self, rid: str) -> bool:
        with self._lock, self.db.conn:
            gone = self.db.conn.execute(f"select {SIZE} from stored where id = ?", [rid]).fetchall()
            self.db.conn.execute("delete from stored where id = ?", [rid])
            self._bytes -= sum(r[0] for r in gone)
            return bool(gone)
