"""Which draft model drafts for a target: LLMD_DRAFT, a pair, a refusal, or one llmd picks."""

from __future__ import annotations

import pytest

from llmd.errors import BadRequest
from llmd.models.drafts import choose_draft
from llmd.models.registry import NO_DRAFT


def row(name: str, n_params: int, family: str = "qwen", draft: str | None = None, fmt: str = "gguf") -> dict:
    return {"name": name, "n_params": n_params, "family": family, "draft": draft, "format": fmt,
            "path": f"/m/{name}.gguf", "digest": name}


def same_family(t: dict, d: dict) -> bool:
    return t["family"] == d["family"]


TARGET = row("coder-1.5b", 1_540_000_000)
ROWS = [TARGET, row("coder-0.5b", 494_000_000), row("coder-0.3b", 300_000_000),
        row("coder-1b", 1_000_000_000), row("other-0.5b", 500_000_000, family="llama"),
        row("remote-0.1b", 100_000_000, fmt="remote")]


def test_the_largest_compatible_model_at_half_the_size_or_less():
    draft, why = choose_draft(TARGET, ROWS, None, True, same_family)
    assert draft is not None and draft["name"] == "coder-0.5b"  # 1b is too large, other-0.5b another vocabulary
    assert why.startswith("paired automatically") and "3.1x fewer parameters" in why


def test_none_when_nothing_fits_or_auto_is_off():
    assert choose_draft(ROWS[1], ROWS, None, True, same_family)[0] is None  # 0.3b is not half of 0.494b
    draft, why = choose_draft(TARGET, ROWS, None, False, same_family)
    assert draft is None and "LLMD_AUTO_DRAFT=0" in why


def test_a_refusal_and_an_explicit_pair_win_over_auto():
    refused = {**TARGET, "draft": NO_DRAFT}
    draft, why = choose_draft(refused, ROWS, None, True, same_family)
    assert draft is None and "--none" in why
    paired = {**TARGET, "draft": "coder-0.3b"}
    assert choose_draft(paired, ROWS, None, True, same_family)[0]["name"] == "coder-0.3b"


def test_llmd_draft_setting_first_and_checked(monkeypatch: pytest.MonkeyPatch):
    draft, why = choose_draft({**TARGET, "draft": "coder-0.3b"}, ROWS, "coder-1b", True, same_family)
    assert draft is not None and draft["name"] == "coder-1b" and why == "set by LLMD_DRAFT"
    import llmd.models.drafts as D

    def refuse(t: dict, d: dict) -> None:
        raise BadRequest("vocabularies differ", "draft")

    monkeypatch.setattr(D, "check_pair", refuse)
    with pytest.raises(BadRequest, match="vocabularies differ"):
        choose_draft(TARGET, ROWS, "other-0.5b", True, same_family)
