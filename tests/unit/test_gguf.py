from pathlib import Path

import pytest

from llmd.models.catalog import find_packaged
from llmd.models.gguf import GGUFError, read_gguf

SMOL = find_packaged()["smollm2-135m"]


def test_reads_smollm2_header():
    info = read_gguf(SMOL)
    s = info.summary()
    assert s["arch"] == "llama"
    assert s["quantization"] == "Q4_1"
    assert s["context_length"] == 8192
    assert s["has_chat_template"]
    assert 130e6 < s["n_params"] < 140e6
    assert s["vocab_size"] == 49152
    # 30 layers x 3 KV heads x (64 + 64) dims x 2 bytes
    assert info.kv_bytes_per_token() == 30 * 3 * 128 * 2


def test_truncated_file_is_refused_with_sizes(tmp_path: Path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(SMOL.read_bytes()[: 50_000_000])
    with pytest.raises(GGUFError) as e:
        read_gguf(cut)
    assert "truncated" in str(e.value) and "50000000" in str(e.value)


def test_truncated_header_is_refused(tmp_path: Path):
    cut = tmp_path / "head.gguf"
    cut.write_bytes(SMOL.read_bytes()[:100_000])
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf(cut)


def test_non_gguf_file_is_refused(tmp_path: Path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(bad)
