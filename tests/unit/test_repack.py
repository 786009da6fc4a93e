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


def test_the_mapping_is_given_back_when_weights_are_repacked(monkeypatch):
    """The file pages a repacked weight was copied from stayed resident beside the copy (the whole
    1,060 MiB mapping of the 1.5B beside its 597 MiB repacked buffer). llama-cpp-python 0.3.36's
    llama_model_params has no use_mmap field, so setting it did nothing: the pages are given back
    after the load instead."""
    import llama_cpp as L

    from llmd.backends.llamacpp import context

    released: list[str] = []
    monkeypatch.setattr(L, "llama_model_load_from_file", lambda path, mp: 1)
    monkeypatch.setattr(context, "release_mapped", lambda path: released.append(path) or 0)
    context.load_model("a.gguf", 0, repack=True)
    context.load_model("b.gguf", 0, repack=False)
    context.load_model("c.gguf", 8, repack=True)  # offloaded layers are copied to the GPU: nothing to give back
    assert released == ["a.gguf"]


def test_release_mapped_drops_a_files_resident_pages(tmp_path):
    import mmap

    from llmd.backends.llamacpp.context import release_mapped

    f = tmp_path / "weights.gguf"
    f.write_bytes(b"w" * (16 << 20))

    def resident_kib() -> int:
        kib, inside = 0, False
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                if "-" in line.split()[0] and len(line.split()) >= 5:
                    inside = line.rstrip().endswith(str(f))
                elif inside and line.startswith("Rss:"):
                    kib += int(line.split()[1])
        return kib

    with open(f, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        assert sum(m[i] for i in range(0, len(m), 4096)) > 0  # every page touched
        assert resident_kib() >= 15 * 1024
        assert release_mapped(str(f)) >= 16 << 20
        assert resident_kib() < 1024
        assert m[12345] == ord("w")  # still readable: the page comes back from the page cache
        m.close()
