"""SQLite exact-match response cache.

Only deterministic requests are cached (temperature 0, or a seed given). The key is a sha256
over everything that changes the output: the model's content digest, the engine and its
precision, the normalized request (messages or prompt, response format, stop) and every
sampling field. A hit replays the stored text pieces, finish reason and usage, so a client sees
the same shape as on the miss that stored it. TTL and a size bound with least-recently-used
eviction keep it small.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from llmd.backends.base import GenerationRequest, StructuredCall, Usage, reply_fields
from llmd.db import open_cache_db

log = logging.getLogger("llmd.response_cache")


def _m001_responses(db: sqlite_utils.Database) -> None:
    db.table("responses").create(
        {"key": str, "model": str, "pieces": str, "finish_reason": str, "usage": str, "size": int,
         "created_at": float, "last_used": float, "hits": int},
        pk="key",
    )
    db.table("responses").create_index(["last_used"])


def _m002_tool_calls(db: sqlite_utils.Database) -> None:
    # calls a remote upstream parsed (JSON list of [id, name, arguments]); local replies hold theirs as text
    db.table("responses").add_column("tool_calls", str, not_null_default="")


MIGRATIONS = [("001_responses", _m001_responses), ("002_tool_calls", _m002_tool_calls)]


@dataclass(frozen=True)
class Cached:
    pieces: list[str]
    finish_reason: str
    usage: Usage
    tool_calls: tuple[StructuredCall, ...] = ()


def cacheable(req: GenerationRequest) -> bool:
    # max_tokens 0 warms the engine's prefix cache: replaying it from here would warm nothing
    # logprobs are not stored with the text: such a reply is computed each time
    return ((req.sampling.greedy or req.sampling.seed is not None) and req.max_tokens != 0
            and req.top_logprobs is None)


def cache_key(req: GenerationRequest, model: dict[str, Any], engine: str, served: dict[str, Any] | None = None
              ) -> str:
    """Every field that can change the reply, and nothing that cannot (the request id, cache_prompt).
    `served`: how the daemon serves it (the batching policy, the llama.cpp build, the loaded
    context, weight repacking and GPU split; routes/_common._served): after a switch to the exact
    policy, a new llama.cpp or a context in which other messages are dropped, replies of the old
    are never replayed."""
    what = {
        "v": 1,
        **({"served": served} if served else {}),
        "model_digest": model["digest"],
        "engine": engine,
        "precision": model.get("quantization"),
        **reply_fields(req),
    }
    blob = json.dumps(what, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _disposable(default: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A cache is disposable: a database error while serving moves the damaged file aside, starts
    an empty one and answers as a miss, never a 500."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(self: ResponseCache, *args: Any, **kw: Any) -> Any:
            try:
                with self._lock:  # called from worker threads, one at a time
                    return fn(self, *args, **kw)
            except sqlite3.DatabaseError as e:
                log.warning("response cache %s failed (%s); rebuilding it", self.path, e)
                self.db.conn.close()
                aside = self.path.with_name(self.path.name + ".corrupt")
                if self.path.exists():
                    os.replace(self.path, aside)
                self.db = open_cache_db(self.path, MIGRATIONS)
                return default
        return guarded
    return wrap


class ResponseCache:
    def __init__(self, path: Path, ttl_s: float = 3600.0, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.path = path
        self._lock = threading.RLock()
        self.db = open_cache_db(path, MIGRATIONS)
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.bypasses = 0

    @_disposable(None)
    def get(self, key: str) -> Cached | None:
        rows = list(self.db.query("select * from responses where key = ?", [key]))
        now = time.time()
        if not rows:
            self.misses += 1
            return None
        row = rows[0]
        if row["created_at"] + self.ttl_s < now:
            self.db.execute("delete from responses where key = ?", [key])
            self.db.conn.commit()
            self.misses += 1
            return None
        self.db.execute("update responses set last_used = ?, hits = hits + 1 where key = ?", [now, key])
        self.db.conn.commit()
        self.hits += 1
        calls = tuple(tuple(c) for c in json.loads(row["tool_calls"])) if row.get("tool_calls") else ()
        return Cached(json.loads(row["pieces"]), row["finish_reason"], Usage(**json.loads(row["usage"])),
                      calls)

    @_disposable(None)
    def put(self, key: str, model: str, pieces: list[str], finish_reason: str, usage: Usage,
            tool_calls: list[Any] | tuple[Any, ...] = ()) -> None:
        body = json.dumps(pieces, ensure_ascii=False)
        usage_json = json.dumps(dataclasses.asdict(usage))
        calls = json.dumps([list(c) for c in tool_calls], ensure_ascii=False) if tool_calls else ""
        size = len(body.encode()) + len(usage_json) + len(calls.encode()) + 128
        now = time.time()
        self.db.table("responses").upsert({"key": key, "model": model, "pieces": body, "finish_reason": finish_reason,
                                           "usage": usage_json, "tool_calls": calls, "size": size, "created_at": now,
                                           "last_used": now, "hits": 0}, pk="key")
        self._evict()

    def _evict(self) -> None:
        total = self.db.execute("select coalesce(sum(size), 0) from responses").fetchone()[0]
        if total <= self.max_bytes:
            return
        excess = total - self.max_bytes
        freed = 0
        doomed = []
        for key, size in self.db.execute("select key, size from responses order by last_used"):
            doomed.append(key)
            freed += size
            if freed >= excess:
                break
        with self.db.conn:
            self.db.conn.executemany("delete from responses where key = ?", [(k,) for k in doomed])
        log.info("response cache: evicted %d entries (%d bytes) to stay under %d", len(doomed), freed, self.max_bytes)

    @_disposable({"entries": 0, "bytes": 0, "rebuilt": True})
    def stats(self) -> dict[str, Any]:
        entries, size = self.db.execute("select count(*), coalesce(sum(size), 0) from responses").fetchone()
        return {"entries": entries, "bytes": size, "max_bytes": self.max_bytes, "ttl_s": self.ttl_s,
                "hits": self.hits, "misses": self.misses, "bypasses": self.bypasses}

    @_disposable(0)
    def clear(self) -> int:
        n = self.db.execute("select count(*) from responses").fetchone()[0]
        with self.db.conn:
            self.db.conn.execute("delete from responses")
        return n
