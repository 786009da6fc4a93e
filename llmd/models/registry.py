"""The models table: add, list, remove, resolve a name.

Packaged models are registered automatically on open. Each row records what the GGUF header
says (arch, parameters, quantization, context, chat template) and a content digest, computed
once and recomputed only when the file's size or mtime changes.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import sqlite_utils

from llmd.db import open_store_db
from llmd.errors import BadRequest, ModelNotFound
from llmd.models.catalog import find_packaged
from llmd.models.checkpoint import read_checkpoint
from llmd.models.digest import file_digest
from llmd.models.gguf import read_gguf
from llmd.models.hub import files_of, is_hub_ref, parse_ref
from llmd.models.vocab import incompatibilities, read_vocab


def _m001_models(db: sqlite_utils.Database) -> None:
    db.table("models").create(
        {
            "name": str, "path": str, "format": str, "source": str, "digest": str, "size": int, "mtime": float,
            "arch": str, "n_params": int, "quantization": str, "context_length": int,
            "has_chat_template": int, "added_at": float,
        },
        pk="name",
    )


def _m002_packaged_seen(db: sqlite_utils.Database) -> None:
    # packaged models are added once; a user's `llmd models rm` is not undone at the next start
    db.table("packaged_seen").create({"name": str}, pk="name")


def _m003_lineage_and_eval(db: sqlite_utils.Database) -> None:
    db.table("models").add_column("parent", str)  # the model this one was quantized from
    db.table("models").add_column("quant_type", str)
    db.table("models").add_column("eval", str)  # JSON: the last `llmd eval` result


def _m004_checkpoint(db: sqlite_utils.Database) -> None:
    db.table("models").add_column("hf_path", str)  # a HF checkpoint or engine folder beside the GGUF


def _m005_draft(db: sqlite_utils.Database) -> None:
    db.table("models").add_column("draft", str)  # the paired draft model's name, for speculation


def _m006_origin(db: sqlite_utils.Database) -> None:
    db.table("models").add_column("origin", str)  # pulled: the Hub reference asked for (hf.co/USER/REPO:QUANT)


def _m007_remote(db: sqlite_utils.Database) -> None:
    db.table("models").add_column("remote", str)  # format "remote": RemoteSpec JSON (URLs, never a key)


MIGRATIONS = [("001_models", _m001_models), ("002_packaged_seen", _m002_packaged_seen),
              ("003_lineage_and_eval", _m003_lineage_and_eval), ("004_checkpoint", _m004_checkpoint),
              ("005_draft", _m005_draft), ("006_origin", _m006_origin), ("007_remote", _m007_remote)]
# a model name: Ollama-style, parts separated by "/" as imported and Hub names have them
# (hf.co/org/repo:Q4_K_M), each part starting with a letter or digit (no empty or ".." parts)
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:-]*(/[A-Za-z0-9][A-Za-z0-9._:-]*)*$"
OWNED = ("created", "pulled")  # sources whose files llmd made, and so may delete


NO_DRAFT = ""  # the draft column when the user refused a draft (`llmd models pair T --none`); NULL: automatic
def check_pair(target: dict[str, Any], draft: dict[str, Any]) -> None:
    """Raise BadRequest naming every difference that stops `draft` drafting for `target`."""
    if target["name"] == draft["name"]:
        raise BadRequest(f"{target['name']} cannot be its own draft model; pick a smaller model with the "
                         "same vocabulary", "draft")
    for row in (target, draft):
        if row["format"] != "gguf":
            raise BadRequest(f"{row['name']} is a {row['format']} folder; draft pairs are GGUF models for the "
                             "llama.cpp engine", "draft")
    problems = incompatibilities(read_vocab(target["path"]), read_vocab(draft["path"]))
    if problems:
        raise BadRequest(f"{draft['name']} cannot draft for {target['name']}: their vocabularies differ ("
                         + "; ".join(problems) + "). A draft model must share the target's tokenizer, "
                         "e.g. a smaller model of the same family", "draft")


class Registry:
    def __init__(self, db_path: Path, models_dir: Path | None = None) -> None:
        self.db = open_store_db(db_path, MIGRATIONS, "model registry")
        self.models_dir = models_dir or db_path.parent / "models"
        # rows by name, read again whenever any connection (this one, or a CLI's) has written: every
        # request looks its model up several times, and a query costs more than the request's own work
        self._rows: dict[str, dict[str, Any] | None] = {}
        self._seen_version: tuple[int, int] = (-1, -1)
        self._names: list[str] | None = None
        # one connection, used from the event loop and from threads (add, pull, remove, import): a
        # transaction of one would commit or roll back another's, and the row cache is shared. Every
        # use of either holds this lock; slow work (reading and hashing a file) is done before.
        self._lock = threading.RLock()

    def sync_packaged(self) -> None:
        with self._lock:
            seen = {r["name"] for r in self.db.table("packaged_seen").rows}
        for name, path in find_packaged(self.models_dir).items():
            row = self._row(name)
            if row is None and name in seen:
                continue  # the user removed it
            if row is None or row["path"] != str(path) or not self._fresh(row):
                self._register(name, path, "package", replace=True)
            with self._lock:
                self.db.table("packaged_seen").upsert({"name": name}, pk="name")

    def add(self, path: Path, name: str | None = None, source: str = "user", **extra: Any) -> dict[str, Any]:
        """Register a GGUF file, or a model folder (HF checkpoint or TensorRT-LLM engine). A folder
        added under the name of a registered GGUF model is attached to it: the model then has both
        formats, and the backend choice can use either."""
        if "\x00" in str(path):
            raise BadRequest("the model path contains a NUL byte; give the path of a .gguf file or a model folder",
                             "path")
        path = path.expanduser().resolve()
        name = name or path.stem.lower()
        if path.is_dir():
            ck = read_checkpoint(path)  # validates before anything is written
            st = path.stat()
            new = {"name": name, "path": str(path), "source": source, "mtime": st.st_mtime, "added_at": time.time(),
                   "hf_path": str(path), **ck.row(), **extra}
            with self._lock:
                row = self._row(name)
                if row is not None and row["format"] == "gguf":
                    self.db.table("models").update(name, {"hf_path": str(path)})
                    return self.get(name)
                self.check_free(name)
                self.db.table("models").insert(new)
                return self.get(name)
        self.check_free(name)  # before hashing gigabytes; checked again when the row is written
        return self._register(name, path, source, **extra)

    def add_remote(self, name: str, spec_json: str, kind: str) -> dict[str, Any]:
        """Register a model served by upstream engines (`spec_json`: a RemoteSpec, checked by the
        caller). Its digest names the upstreams and their model, so cached replies are theirs."""
        self.check_free(name)
        digest = "remote:" + hashlib.sha256(spec_json.encode()).hexdigest()
        spec = json.loads(spec_json)
        with self._lock:
            self.check_free(name)
            self.db.table("models").insert({
            "name": name, "path": spec["urls"][0], "format": "remote", "source": "remote", "digest": digest,
            "size": 0, "mtime": 0.0, "arch": kind, "n_params": 0, "quantization": "", "context_length": 0,
            "has_chat_template": 0, "added_at": time.time(), "remote": spec_json})
            return self.get(name)

    def check_free(self, name: str) -> None:
        """A new name: well formed (one rule for every way a name is made) and not taken."""
        if not re.fullmatch(MODEL_NAME, name):
            raise BadRequest(f"{name!r} is not a model name: letters, digits and . _ : - in parts separated by /, "
                             "each part starting with a letter or digit (no empty or '..' parts)", "name")
        if self._row(name) is not None:
            raise BadRequest(f"a model named {name!r} is already registered; pick another with --name", "name")

    def set_eval(self, name: str, result: dict[str, Any]) -> None:
        with self._lock:
            self.db.table("models").update(self.get(name)["name"], {"eval": json.dumps(result)})

    def pair(self, target: str, draft: str | None, checked: bool = False) -> dict[str, Any]:
        """Make `draft` the target's draft model for speculation: NO_DRAFT refuses any (automatic
        pairing included), None goes back to automatic pairing. Refused, with what differs, unless
        both are GGUF models with compatible vocabularies (`checked`: the caller ran check_pair
        already, off the thread that owns this registry)."""
        row = self.get(target)
        if draft:
            draft_row = self.get(draft)
            draft = draft_row["name"]  # `name:latest` is the model registered as `name`
            if not checked:
                check_pair(row, draft_row)
        with self._lock:
            self.get(target)  # still there
            self.db.table("models").update(row["name"], {"draft": draft})
            return self.get(row["name"])

    def remove(self, name: str) -> dict[str, Any]:
        """Unregister; delete the file only if llmd made it (never a user's, a package's or another
        tool's file). The row comes back with `deleted_file`."""
        with self._lock:
            row = self.get(name)
            name = row["name"]  # `name:latest` is the model registered as `name`
            users = [r["name"] for r in self.db.table("models").rows_where("draft = ?", [name])]
            if users:
                raise BadRequest(f"{name} is the draft model of {', '.join(users)}; unpair it first "
                                 f"(`llmd models pair {users[0]} --none`)", "name")
            deletes = self.deletes_files(row)
            self.db.table("models").delete(name)
        if deletes:
            for f in files_of(Path(row["path"])):  # every part of a split model
                f.unlink(missing_ok=True)
        return {**row, "deleted_file": deletes}

    def deletes_files(self, row: dict[str, Any]) -> bool:
        """Whether removing `row` deletes its file: only one llmd made (quantized or pulled), never
        another tool's (ollama, lmstudio, hf imports) or a user's, and not while a copy uses it."""
        with self._lock:
            shared = self.db.table("models").count_where("path = ? and name != ?", [row["path"], row["name"]])
        return row["source"] in OWNED and not shared

    def copy(self, source: str, destination: str) -> dict[str, Any]:
        """Register the same file under another name (Ollama's copy): no bytes are copied."""
        with self._lock:
            row = dict(self.get(source))
            self.check_free(destination)
            row.update(name=destination, added_at=time.time(), draft=None, origin=None)
            self.db.table("models").insert(row)
            return self.get(destination)

    def names(self) -> list[str]:
        """The registered names, sorted; read again only after a write (for the tray's state,
        which every /llmd/events subscriber asks for at each change)."""
        with self._lock:
            self._fresh_version()
            if self._names is None:
                self._names = [r[0] for r in self.db.execute("select name from models order by name")]
            return list(self._names)

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.db.table("models").rows_where(order_by="name"))

    def get(self, name: str) -> dict[str, Any]:
        row = self._row(name)
        if row is None and name.endswith(":latest"):  # Ollama's default tag names the untagged model
            row = self._row(name[: -len(":latest")])
        if row is None and is_hub_ref(name):  # a model pulled by this reference
            row = self._by_origin(name)
        if row is None:
            known = ", ".join(r["name"] for r in self.list()) or "none"
            raise ModelNotFound(f"model {name!r} is not registered (registered: {known}); add it with `llmd models add PATH.gguf`", "model")
        return row

    def has(self, name: str) -> bool:
        return self._row(name) is not None

    def _by_origin(self, ref: str) -> dict[str, Any] | None:
        try:
            origin = parse_ref(ref).origin
        except BadRequest:
            return None
        with self._lock:
            rows = list(self.db.table("models").rows_where("lower(origin) = lower(?)", [origin]))
        return rows[0] if rows else None

    def _fresh_version(self) -> None:
        """Forget cached rows when any connection (this one, or a CLI's) has written since."""
        version = (self.db.execute("PRAGMA data_version").fetchone()[0], self.db.conn.total_changes)
        if version != self._seen_version:
            self._rows.clear()
            self._names = None
            self._seen_version = version

    def _row(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            self._fresh_version()
            if name not in self._rows:
                rows = list(self.db.table("models").rows_where("name = ?", [name]))
                self._rows[name] = rows[0] if rows else None
            row = self._rows[name]
        return dict(row) if row is not None else None

    @staticmethod
    def _fresh(row: dict[str, Any]) -> bool:
        if row.get("format", "gguf") != "gguf":  # folders and remote models have no file to watch
            return True
        p = Path(row["path"])
        try:
            st = p.stat()
        except OSError:
            return False
        return st.st_size == row["size"] and st.st_mtime == row["mtime"]

    def _register(self, name: str, path: Path, source: str, replace: bool = False, **extra: Any) -> dict[str, Any]:
        info = read_gguf(path)  # validates before anything is written
        st = path.stat()
        # a store that names files by their sha256 (Ollama, the Hub cache) saves hashing gigabytes again
        digest = extra.pop("digest", None) or file_digest(path)
        row = {
            "name": name, "path": str(path), "format": "gguf", "source": source, "digest": digest,
            "size": st.st_size, "mtime": st.st_mtime, "arch": info.arch, "n_params": info.n_params,
            "quantization": info.quantization, "context_length": info.context_length,
            "has_chat_template": int(info.chat_template is not None), "added_at": time.time(), **extra,
        }
        with self._lock:
            if not replace:
                self.check_free(name)  # another thread may have taken the name while this one hashed
            self.db.table("models").upsert(row, pk="name")
        return row
