"""SQLite through one door: open_db(path, migrations) applies forward-only, uniquely named
migrations once each, in order, and records them in a _migrations table."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import sqlite_utils

Migration = tuple[str, Callable[[sqlite_utils.Database], None]]


def open_db(path: Path, migrations: Sequence[Migration]) -> sqlite_utils.Database:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    db = sqlite_utils.Database(path)
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
