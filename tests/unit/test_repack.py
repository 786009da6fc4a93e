"""The repack record: keyed by CPU, llama.cpp build and file type; LLMD_REPACK overrides it."""

from __future__ import annotations

import json
from pathlib import Path

from llmd.backends.repack import RepackRecord


def test_auto_is_on_until_a_crash_is_recorded_for_that_file_type(tmp_path: Path):
    rec = RepackRecord(tmp_path / "repack.json")
    assert rec.decide("auto", ("Q4_1",)).repack is True
    entry = rec.write_crash("Q4_1", "smollm2-135m", "killed by signal 11")
    assert "crashed on this CPU at load" in entry["reason"] and "running without it" in entry["reason"]
    d = rec.decide("auto", ("Q4_1",))
    assert d.repack is False and d.recorded == entry
    assert rec.decide("auto", ("Q8_0",)).repack is True  # another file type uses other kernels
    assert rec.decide("auto", ("F16", "Q4_1")).repack is False  # a target with a crashing draft
    assert rec.decide("on", ("Q4_1",)).repack is True
    assert rec.decide("off", ("Q8_0",)).repack is False
    assert [e["file_type"] for e in rec.here()] == ["Q4_1"]


def test_records_of_another_machine_or_build_do_not_apply(tmp_path: Path):
    path = tmp_path / "repack.json"
    path.write_text(json.dumps({"0123456789abcdef:Q4_1": {"reason": "elsewhere", "file_type": "Q4_1"}}))
    rec = RepackRecord(path)
    assert rec.decide("auto", ("Q4_1",)).repack is True and rec.here() == []


def test_a_damaged_record_is_ignored(tmp_path: Path):
    path = tmp_path / "repack.json"
    path.write_text("{not json")
    assert RepackRecord(path).decide("auto", ("Q4_1",)).repack is True


def test_repacked_weights_are_read_not_mapped(monkeypatch):
    """Mapped, the file pages a repacked weight was copied from stay resident beside the copy."""
    import llama_cpp as L

    from llmd.backends.llamacpp.context import load_model

    seen: list[tuple[bool, bool]] = []
    monkeypatch.setattr(L, "llama_model_load_from_file",
                        lambda path, mp: seen.append((mp.use_extra_bufts, mp.use_mmap)) or 1)
    load_model("m.gguf", 0, repack=True)
    load_model("m.gguf", 0, repack=False)
    load_model("m.gguf", 8, repack=True)  # offloaded layers are copied to the GPU: mapping costs nothing there
    assert seen == [(True, False), (False, True), (True, True)]
