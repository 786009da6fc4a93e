"""Hub references, quantization choice, names and the disk-space refusal (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmd.errors import BadRequest, InsufficientStorage, UpstreamError
from llmd.models import hub
from llmd.models.hub import (
    HubFile,
    HubRef,
    PullPlan,
    _closest,
    files_of,
    inside,
    model_name,
    parse_ref,
    quant_of,
)


@pytest.mark.parametrize("text, want", [
    ("bartowski/Qwen2.5-0.5B-Instruct-GGUF", HubRef("bartowski/Qwen2.5-0.5B-Instruct-GGUF")),
    ("bartowski/Qwen2.5-0.5B-Instruct-GGUF:q4_k_m", HubRef("bartowski/Qwen2.5-0.5B-Instruct-GGUF", "Q4_K_M")),
    ("hf.co/bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q8_0", HubRef("bartowski/Qwen2.5-0.5B-Instruct-GGUF", "Q8_0")),
    ("https://huggingface.co/org/repo:latest", HubRef("org/repo")),
    ("org/repo/model-Q5_K_M.gguf", HubRef("org/repo", filename="model-Q5_K_M.gguf")),
    ("hf.co/unsloth/Qwen3-8B-GGUF:UD-Q4_K_XL", HubRef("unsloth/Qwen3-8B-GGUF", "UD-Q4_K_XL")),
])
def test_references(text: str, want: HubRef):
    assert parse_ref(text) == want


@pytest.mark.parametrize("text", ["llama3.2", "a/b/c", "org/", "../etc/passwd", "org/repo/x.bin", "../etc/x.gguf",
                                  "hf.co/../etc/x.gguf", "org/../x.gguf", "org/repo/..gguf", "org/re..po",
                                  "org/repo:Q4;rm", ".org/repo"])
def test_bad_references_say_what_to_give(text: str):
    with pytest.raises(BadRequest, match="USER/REPO"):
        parse_ref(text)


def test_quantization_from_names_and_the_closest():
    assert quant_of("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("model.q8_0.gguf") == "Q8_0"
    assert quant_of("smollm2-135m-instruct-iq4_xs-00001-of-00002.gguf") == "IQ4_XS"
    assert quant_of("model-f16.gguf") == "F16" and quant_of("model.gguf") is None
    assert _closest("Q4_K_M", ["Q8_0", "Q4_K_S", "Q2_K"]) == "Q4_K_S"
    assert _closest("Q4_K_M", ["Q5_K_M", "Q3_K_L"]) == "Q5_K_M"  # equally near: more bits
    assert model_name(HubRef("bartowski/Qwen2.5-0.5B-Instruct-GGUF"), "Q4_K_M") == "qwen2.5-0.5b-instruct:q4_k_m"
    assert HubRef("org/repo").origin == "hf.co/org/repo:Q4_K_M"


def test_split_parts_are_every_file(tmp_path: Path):
    first = tmp_path / "m-Q4_0-00001-of-00003.gguf"
    assert [p.name for p in files_of(first)] == [f"m-Q4_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert files_of(tmp_path / "m.gguf") == [tmp_path / "m.gguf"]


def test_not_enough_disk_is_refused_with_the_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    class Usage:
        free = 50 * 2**20

    monkeypatch.setattr(hub.shutil, "disk_usage", lambda _p: Usage())
    p = PullPlan(HubRef("org/repo"), "c0ffee", "Q4_K_M", [HubFile("m-Q4_K_M.gguf", 300 * 2**20, None)],
                 "repo:q4_k_m")
    with pytest.raises(InsufficientStorage, match=r"needs 300 MiB more but .* has 50 MiB free"):
        hub.download(p, tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing started


@pytest.mark.parametrize("name", ["../../evil-Q4_K_M.gguf", "/etc/evil.gguf", "sub/../../evil.gguf", "."])
def test_a_listed_file_name_that_leaves_the_folder_is_refused(tmp_path: Path, name: str):
    with pytest.raises(UpstreamError, match="outside"):
        inside(tmp_path / "models", name)
    assert inside(tmp_path / "models", "sub/ok-Q4_K_M.gguf") == (tmp_path / "models" / "sub" / "ok-Q4_K_M.gguf")


def test_a_tag_as_the_repo_spells_it_picks_that_file():
    from types import SimpleNamespace

    names = ["Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B-UD-Q4_K_XL.gguf", "Qwen3-8B-UD-Q2_K_XL.gguf"]
    info = SimpleNamespace(sha="abc", siblings=[SimpleNamespace(rfilename=n, size=10, lfs=None) for n in names])
    api = SimpleNamespace(model_info=lambda repo, files_metadata: info)
    got = hub.plan(parse_ref("unsloth/Qwen3-8B-GGUF:UD-Q4_K_XL"), api)
    assert [f.name for f in got.files] == ["Qwen3-8B-UD-Q4_K_XL.gguf"] and got.name == "qwen3-8b:ud-q4_k_xl"
