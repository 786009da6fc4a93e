"""`llmd quantize` and `llmd eval` on the real SmolLM2: F16 re-encoding, Q8_0 and Q4_0 from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import Daemon

pytestmark = pytest.mark.integration


def llmd(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMD_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "llmd", *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    h = tmp_path_factory.mktemp("quant") / "home"
    r = llmd(h, "quantize", "smollm2-135m", "--type", "F16", "--name", "smol-f16")
    assert r.returncode == 0, r.stderr
    assert "already quantized" in r.stderr  # requantizing cannot gain accuracy: said so
    for t in ("Q8_0", "Q4_0"):
        r = llmd(h, "quantize", "smol-f16", "--type", t, "--name", f"smol-{t.lower()}")
        assert r.returncode == 0, r.stderr
        assert "already quantized" not in r.stderr
    return h


def test_quantized_models_are_registered_with_their_lineage(home: Path):
    import sqlite3

    db = sqlite3.connect(home / "data" / "registry.db")
    rows = {r[0]: r[1:] for r in db.execute("select name, quantization, parent, quant_type, source, size from models")}
    db.close()
    assert rows["smol-f16"][:4] == ("F16", "smollm2-135m", "F16", "created")
    assert rows["smol-q8_0"][:3] == ("Q8_0", "smol-f16", "Q8_0")
    assert rows["smol-q4_0"][:3] == ("Q4_0", "smol-f16", "Q4_0")
    assert rows["smol-f16"][4] > rows["smol-q8_0"][4] > rows["smol-q4_0"][4]


def test_quantized_models_load_and_generate(home: Path):
    d = Daemon(home, env={"LLMD_SLOTS": "1", "LLMD_CTX": "512", "LLMD_PRELOAD": "0"}).start(wait_model=False)
    try:
        for name in ("smol-q8_0", "smol-q4_0"):
            r = httpx.post(d.url + "/v1/chat/completions", timeout=120, json={
                "model": name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6,
                "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name and r.json()["choices"][0]["message"]["content"]
    finally:
        d.stop()


def test_eval_against_itself_and_q8_closer_than_q4(home: Path):
    def ev(*args: str) -> dict:
        r = llmd(home, "eval", *args, "--tokens", "512", "--window", "128", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    same = ev("smol-f16", "--base", "smol-f16")
    assert same["kl_mean"] < 1e-6 and same["top1_agreement"] == 1.0 and abs(same["ppl_ratio"] - 1) < 1e-9
    q8 = ev("smol-q8_0", "--base", "smol-f16")
    q4 = ev("smol-q4_0", "--base", "smol-f16")
    assert q8["kl_mean"] < q4["kl_mean"], (q8, q4)
    assert q8["top1_agreement"] >= q4["top1_agreement"]
    assert q8["tokens_scored"] == q4["tokens_scored"] == 4 * 63
    import sqlite3

    db = sqlite3.connect(home / "data" / "registry.db")
    stored = json.loads(db.execute("select eval from models where name = 'smol-q4_0'").fetchone()[0])
    db.close()
    assert stored["kl_mean"] == q4["kl_mean"] and stored["base"] == "smol-f16"  # `llmd models show` prints it


def test_bad_input_is_refused_and_registers_nothing(home: Path, tmp_path: Path):
    import sqlite3

    def count() -> int:
        db = sqlite3.connect(home / "data" / "registry.db")
        n = db.execute("select count(*) from models").fetchone()[0]
        db.close()
        return n

    before = count()
    r = llmd(home, "quantize", "no-such-model", "--type", "Q4_0")
    assert r.returncode == 1 and "not registered" in r.stderr
    r = llmd(home, "quantize", "smol-f16", "--type", "Q3_XYZ")
    assert r.returncode == 1 and "unknown quantization type" in r.stderr and "Q4_K_M" in r.stderr
    short = tmp_path / "short.txt"
    short.write_text("Too short to evaluate.")
    r = llmd(home, "eval", "smol-q8_0", "--base", "smol-f16", "--text", str(short), "--window", "128")
    assert r.returncode == 1 and "one evaluation window needs 128" in r.stderr
    r = llmd(home, "eval", "nope")
    assert r.returncode == 1 and "not registered" in r.stderr
    assert count() == before
    assert not list((home / "data" / "models").glob("*.partial"))
