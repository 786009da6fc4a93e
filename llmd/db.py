"""SQLite through one door: open_db(path, migrations) applies forward-only, uniquely named
migrations once each, in order, and records them in a _migrations table."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import sqlite_utils

log = logging.getLogger("llmd.db")

Migration = tuple[str, Callable[[sqlite_utils.Database], None]]


def open_db(path: Path, migrations: Sequence[Migration]) -> sqlite_utils.Database:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    # usable from worker threads (the event loop hands slow calls to them); callers serialize writes
    db = sqlite_utils.Database(sqlite3.connect(str(path), check_same_thread=False))
    if new:
        os.chmod(path, 0o600)
    db.enable_wal()
    db.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints, no fsync per commit
    db.execute("PRAGMA busy_timeout = 5000")
    names = [name for name, _ in migrations]
    if len(set(names)) != len(names):
        raise ValueError(f"migration names must be unique: {names}")
    db.table("_migrations").create({"name": str, "applied_at": float}, pk="name", if_not_exists=True)
    done = {row["name"] for row in db.table("_migrations").rows}

    for name, fn in migrations:
        if name in done:
            continue
        with db.conn:
            fn(db)
            db.table("_migrations").insert({"name": name, "applied_at": time.time()})
    return db


def open_cache_db(path: Path, migrations: Sequence[Migration]) -> sqlite_utils.Database:
    """open_db for a cache, which is disposable: a damaged file is moved aside (kept as
    NAME.corrupt for a post-mortem), logged, and a new empty one is made."""
    try:
        db = open_db(path, migrations)
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("quick_check failed")
        return db
    except sqlite3.DatabaseError as e:
        aside = path.with_name(path.name + ".corrupt")
        log.warning("cache database %s is damaged (%s); moved it to %s and starting an empty one", path, e, aside)
        os.replace(path, aside)
        for suffix in ("-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)
        return open_db(path, migrations)


def open_store_db(path: Path, migrations: Sequence[Migration], what: str) -> sqlite_utils.Database:
    """open_db for data that is not disposable (the registry): a damaged file stops the start with
    a message that names it, after keeping a copy, and says how to recover."""
    try:
        db = open_db(path, migrations)
        db.execute("PRAGMA quick_check").fetchone()
        return db
    except sqlite3.DatabaseError as e:
        from llmd.errors import LlmdError

        copy = path.with_name(path.name + f".damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copy2(path, copy)
        raise LlmdError(
            f"the {what} database {path} is damaged ({e}); a copy is kept at {copy}. To recover, move {path} "
            f"away and start llmd again: it makes a new one with the packaged models, and you add your own "
            f"again with `llmd models add`") from None
