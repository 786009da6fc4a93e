import sqlite3
import time
from pathlib import Path

from llmd.backends.base import GenerationRequest, Sampling, Usage
from llmd.daemon.response_cache import ResponseCache, cache_key, cacheable

MODEL = {"digest": "sha256:abc", "quantization": "Q4_1"}
U = Usage(3, 2, 0, 0.1, 0.1, 0.1)


def req(**kw) -> GenerationRequest:
    return GenerationRequest(id=kw.pop("id", "a"), messages=[{"role": "user", "content": "hi"}], **kw)


def test_key_ignores_request_id_and_cache_prompt_but_not_sampling():
    base = cache_key(req(sampling=Sampling(temperature=0)), MODEL, "llama.cpp")
    assert cache_key(req(id="b", cache_prompt=False, sampling=Sampling(temperature=0)), MODEL, "llama.cpp") == base
    assert cache_key(req(sampling=Sampling(temperature=0, top_k=3)), MODEL, "llama.cpp") != base
    assert cache_key(req(sampling=Sampling(temperature=0)), {**MODEL, "digest": "sha256:x"}, "llama.cpp") != base
    assert cache_key(req(sampling=Sampling(temperature=0)), MODEL, "tensorrt") != base
    assert cache_key(req(sampling=Sampling(temperature=0), stop=("a",)), MODEL, "llama.cpp") != base


def test_only_deterministic_requests_are_cacheable():
    assert cacheable(req(sampling=Sampling(temperature=0)))
    assert cacheable(req(sampling=Sampling(temperature=0.9, seed=1)))
    assert not cacheable(req(sampling=Sampling(temperature=0.9)))


def test_roundtrip_ttl_and_file_mode(tmp_path: Path):
    c = ResponseCache(tmp_path / "r.db", ttl_s=0.2)
    c.put("k", "m", ["a", "b"], "stop", U)
    hit = c.get("k")
    assert hit is not None and hit.pieces == ["a", "b"] and hit.usage == U and hit.finish_reason == "stop"
    assert (tmp_path / "r.db").stat().st_mode & 0o777 == 0o600
    time.sleep(0.3)
    assert c.get("k") is None


def test_size_bound_evicts_least_recently_used(tmp_path: Path):
    c = ResponseCache(tmp_path / "r.db", max_bytes=5000)
    for i in range(10):
        c.put(f"k{i}", "m", ["x" * 900], "stop", U)
        time.sleep(0.002)
        c.get("k0")  # keep k0 fresh
    assert c.stats()["bytes"] <= 5000
    assert c.get("k0") is not None and c.get("k1") is None and c.get("k9") is not None


def test_journal_is_wal(tmp_path: Path):
    ResponseCache(tmp_path / "r.db")
    assert sqlite3.connect(tmp_path / "r.db").execute("pragma journal_mode").fetchone()[0] == "wal"


def test_structured_tool_calls_are_stored_with_the_reply(tmp_path: Path):
    c = ResponseCache(tmp_path / "r.db")
    u = Usage(1, 2, 0, 0.1, 0.1, 0.1)
    c.put("k", "m", ["Checking."], "stop", u, [("call_up_1", "add", '{"a": 1}')])
    c.put("plain", "m", ["hi"], "stop", u)
    assert c.get("k").tool_calls == (("call_up_1", "add", '{"a": 1}'),)
    assert c.get("plain").tool_calls == ()


def test_a_cache_made_before_tool_calls_were_stored_opens_and_serves(tmp_path: Path):
    from llmd.daemon.response_cache import MIGRATIONS
    from llmd.db import open_cache_db

    old = open_cache_db(tmp_path / "r.db", MIGRATIONS[:1])
    now = time.time()
    old.table("responses").insert({"key": "k", "model": "m", "pieces": '["hi"]', "finish_reason": "stop",
                                   "usage": '{"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0, '
                                            '"ttft_s": 0.1, "prefill_s": 0.1, "decode_s": 0.1}',
                                   "size": 10, "created_at": now, "last_used": now, "hits": 0})
    old.conn.commit()
    old.conn.close()
    hit = ResponseCache(tmp_path / "r.db").get("k")
    assert hit is not None and hit.pieces == ["hi"] and hit.tool_calls == ()


def test_how_the_daemon_serves_is_in_the_key():
    r = req(sampling=Sampling(temperature=0))
    fast = cache_key(r, MODEL, "llama.cpp", {"policy": "fast", "gpu_layers": -1, "llama_cpp": "0.3.36"})
    assert cache_key(r, MODEL, "llama.cpp", {"policy": "exact", "gpu_layers": -1, "llama_cpp": "0.3.36"}) != fast
    assert cache_key(r, MODEL, "llama.cpp", {"policy": "fast", "gpu_layers": -1, "llama_cpp": "0.3.37"}) != fast
    assert cache_key(r, MODEL, "llama.cpp", {"policy": "fast", "gpu_layers": 10, "llama_cpp": "0.3.36"}) != fast
    assert cache_key(r, MODEL, "llama.cpp", {"policy": "fast", "gpu_layers": -1, "llama_cpp": "0.3.36",
                                            "n_ctx": 8192}) != fast
