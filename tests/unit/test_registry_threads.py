"""The registry is used from the event loop and from threads at once (adds, pulls, removes)."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from llmd.errors import BadRequest
from llmd.models.registry import Registry

SPEC = json.dumps({"urls": ["http://127.0.0.1:9/v1"], "kind": "openai", "upstream_model": "m",
                   "api_key_env": "", "api_key_file": ""})


def test_concurrent_adds_removes_and_reads_leave_the_table_exact(tmp_path: Path):
    reg = Registry(tmp_path / "registry.db", tmp_path / "models")
    errors: list[BaseException] = []
    kept: list[str] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        try:
            for i in range(40):
                name = f"m{t}-{i}"
                reg.add_remote(name, SPEC, "openai")
                reg.copy(name, name + "-copy")
                assert reg.get(name)["name"] == name
                reg.list()
                reg.remove(name)
                if i % 2:
                    reg.remove(name + "-copy")
                else:
                    with lock:
                        kept.append(name + "-copy")
        except BaseException as e:  # noqa: BLE001 - reported below with the thread's work
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    db = sqlite3.connect(tmp_path / "registry.db")
    names = {r[0] for r in db.execute("select name from models")}
    db.close()
    assert names == set(kept)
    assert {r["name"] for r in reg.list()} == set(kept)


def test_two_threads_adding_one_name_get_one_row_and_one_clear_refusal(tmp_path: Path):
    reg = Registry(tmp_path / "registry.db", tmp_path / "models")
    results: list[str] = []
    barrier = threading.Barrier(8)

    def add() -> None:
        barrier.wait()
        try:
            reg.add_remote("same", SPEC, "openai")
            results.append("added")
        except BadRequest as e:
            results.append("taken" if "already registered" in str(e) else repr(e))
        except Exception as e:  # noqa: BLE001 - an IntegrityError here is the bug
            results.append(repr(e))

    threads = [threading.Thread(target=add) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(results) == ["added"] + ["taken"] * 7


def test_names_are_read_again_only_after_a_write(tmp_path: Path):
    reg = Registry(tmp_path / "registry.db", tmp_path / "models")
    reg.add_remote("b-model", SPEC, "openai")
    assert reg.names() == ["b-model"]
    queries: list[str] = []
    reg.db.conn.set_trace_callback(queries.append)
    assert reg.names() == ["b-model"] and not [q for q in queries if "from models" in q]  # cached
    other = Registry(tmp_path / "registry.db", tmp_path / "models")  # a CLI's connection writes
    other.add_remote("a-model", SPEC, "openai")
    assert reg.names() == ["a-model", "b-model"]


def test_a_name_with_a_dot_dot_part_is_refused_on_every_path(tmp_path: Path):
    import pytest

    reg = Registry(tmp_path / "registry.db", tmp_path / "models")
    reg.add_remote("ok", SPEC, "openai")
    for bad in ("../etc", "a/../b", "a//b", "/abs", ".hidden"):
        with pytest.raises(BadRequest, match="not a model name"):
            reg.copy("ok", bad)
        with pytest.raises(BadRequest, match="not a model name"):
            reg.add_remote(bad, SPEC, "openai")
    assert reg.copy("ok", "hf.co/org/repo:UD-Q4_K_XL")["name"] == "hf.co/org/repo:UD-Q4_K_XL"
