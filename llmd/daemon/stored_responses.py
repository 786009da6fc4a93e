"""Responses kept for the Responses API: `previous_response_id` continues a stored conversation,
and GET / DELETE /v1/responses/{id} read and remove one.

A stored response keeps the conversation that led to it (as chat messages) and its reply (the
Response object), so a follow-up rebuilds the whole history without the client resending it.
Kept 30 days, like OpenAI's, in DATA/responses_api.db; a damaged file is moved aside and
rebuilt (a follow-up then gets a 404 naming the id, never a 500).
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


def _m001_stored(db: sqlite_utils.Database) -> None:
    db.table("stored").create({"id": str, "model": str, "messages": str, "response": str, "created_at": float},
                              pk="id")
    db.table("stored").create_index(["created_at"])


MIGRATIONS = [("001_stored", _m001_stored)]


class StoredResponses:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.db = open_cache_db(path, MIGRATIONS)
        with self._lock, self.db.conn:
            self.db.conn.execute("delete from stored where created_at < ?", [time.time() - KEEP_S])

    def put(self, rid: str, model: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        with self._lock:
            self.db.table("stored").upsert({"id": rid, "model": model, "messages": json.dumps(messages, ensure_ascii=False),
                                            "response": json.dumps(response, ensure_ascii=False),
                                            "created_at": time.time()}, pk="id")

    def get(self, rid: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        with self._lock:
            rows = list(self.db.query("select messages, response from stored where id = ?", [rid]))
        if not rows:
            return None
        return json.loads(rows[0]["messages"]), json.loads(rows[0]["response"])

    def delete(self, rid: str) -> bool:
        with self._lock, self.db.conn:
            return self.db.conn.execute("delete from stored where id = ?", [rid]).rowcount > 0
