"""The cost-aware choice of drafter and draft length, the vocabulary check and LLMD_DRAFT parsing."""

from __future__ import annotations

from typing import Any

import pytest

from llmd.backends.base import GenerationRequest
from llmd.backends.llamacpp.slots import Active
from llmd.backends.llamacpp.speculation import PROBE_EVERY, Job, Speculator
from llmd.config import draft_pairs, load_settings
from llmd.errors import BadRequest
from llmd.models.vocab import Vocab, incompatibilities

# measured on the 2-core test machine, SmolLM2 F16 target (seconds for k drafts + 1 row)
COST = {0: 0.0275, 1: 0.0335, 2: 0.0393, 4: 0.0593, 8: 0.0927}


class FakeDraft:
    def __init__(self, step_s: float) -> None:
        self.step_s, self.catchup_s = step_s, 0.0
        self.seqs: list[list[int]] = [[], []]
        self.calls: list[list[tuple[int, list[int], int]]] = []

    def propose(self, jobs: list[tuple[int, list[int], int]]) -> list[list[int]]:
        self.calls.append(jobs)
        return [[7] * k for _, _, k in jobs]

    def info(self) -> dict[str, Any]:
        return {}


def active(drafters: tuple[str, ...], **ema: float) -> Active:
    a = Active(GenerationRequest(id="r"), [1], 100, None, None, 0.0)  # type: ignore[arg-type]
    a.drafters, a.accept_ema = drafters, dict(ema)
    return a


def spec(step_s: float | None = None) -> Speculator:
    s = Speculator(FakeDraft(step_s) if step_s is not None else None)  # type: ignore[arg-type]
    s.cost = dict(COST)
    return s


def test_high_acceptance_drafts_long_and_low_acceptance_does_not_draft():
    s = spec()
    assert s._choose(active(("ngram",), ngram=1.0), 0, 100) == ("ngram", 8)
    assert s._choose(active(("ngram",), ngram=0.15), 0, 100) == ("", 0)


def test_a_busy_batch_makes_drafting_pay_less():
    # alone, p=0.75 pays for a short draft; with 3 other slots decoding, the rows are dearer for all
    s = spec()
    assert s._choose(active(("ngram",), ngram=0.75), 0, 100)[1] > 0
    assert s._choose(active(("ngram",), ngram=0.75), 3, 100) == ("", 0)


def test_draft_model_cost_shortens_its_drafts_and_room_caps_them():
    free, dear = spec(0.0), spec(0.012)
    k_free = free._choose(active(("draft",), draft=0.95), 0, 100)[1]
    k_dear = dear._choose(active(("draft",), draft=0.95), 0, 100)[1]
    assert k_free > k_dear > 0
    assert free._choose(active(("draft",), draft=1.0), 0, 3) == ("draft", 3)


def test_a_long_catch_up_is_weighed_against_a_typical_reply_not_the_context_end():
    s = spec(0.003)
    s.draft.catchup_s = 0.003  # type: ignore[union-attr]
    a = active(("ngram", "draft"), ngram=0.0, draft=0.95)
    assert s._choose(a, 0, 24000, gap=60)[0] == "draft"  # a short prompt: worth catching up
    assert s._choose(a, 0, 24000, gap=8600) == ("", 0)  # a Codex-sized prompt for a short reply: not


def test_no_drafting_still_probes_now_and_then():
    s = spec()
    a = active(("ngram",), ngram=0.0)
    picks = [s._choose(a, 0, 100) for _ in range(PROBE_EVERY)]
    assert picks[:-1] == [("", 0)] * (PROBE_EVERY - 1) and picks[-1] == ("ngram", 1)


def test_until_measured_only_probes_draft():
    s = Speculator()
    assert s._choose(active(("ngram",), ngram=1.0), 0, 100) == ("", 0) and s.want_cost


def test_plan_batches_draft_model_jobs_and_falls_back_from_an_empty_ngram():
    s = spec(0.001)
    a1, a2 = active(("ngram", "draft"), ngram=1.0, draft=1.0), active(("draft",), draft=1.0)
    out = s.plan([Job(a1, 0, [1, 2, 3], 50), Job(a2, 1, [4, 5], 50)], rows=2)
    assert len(s.draft.calls) == 1 and [seq for seq, _, _ in s.draft.calls[0]] == [0, 1]  # type: ignore[union-attr]
    assert out[0] and out[1] and a1.last_drafter == "draft"  # no n-gram match in [1, 2, 3]


def test_cost_between_and_beyond_measured_points():
    s = spec()
    assert s.t(3) == pytest.approx((COST[2] + COST[4]) / 2)
    assert s.t(12) == pytest.approx(COST[8] + (COST[8] - COST[4]))


def test_modes():
    s = spec()
    assert s.drafters_for("off") == () and s.drafters_for("auto") == ("ngram",)
    with pytest.raises(BadRequest, match="llmd models pair"):
        s.drafters_for("draft")
    assert spec(0.01).drafters_for("auto") == ("ngram", "draft")


def vocab(**kw: Any) -> Vocab:
    base = {"kind": "gpt2", "tokens": tuple(f"t{i}" for i in range(300)), "bos": 1, "eos": 2, "add_bos": False,
            "add_eos": None}
    return Vocab(**{**base, **kw})


def test_vocabulary_check():
    assert incompatibilities(vocab(), vocab(add_eos=False)) == []
    assert incompatibilities(vocab(), vocab(tokens=vocab().tokens + ("x",) * 100)) == []  # within 128
    assert "sizes differ by 200" in incompatibilities(vocab(), vocab(tokens=vocab().tokens + ("x",) * 200))[0]
    swapped = vocab(tokens=vocab().tokens[:9] + ("other",) + vocab().tokens[10:])
    assert incompatibilities(vocab(), swapped) == ["token 9 differs: target 't9', draft 'other'"]
    early = vocab(tokens=("a",) + vocab().tokens[1:])
    assert incompatibilities(vocab(), early) == []  # ids under 5 are specials some exports rename
    assert len(incompatibilities(vocab(), vocab(kind="llama", eos=5))) == 2


def test_draft_pairs_setting():
    assert draft_pairs(" big=small, b2 = s2 ,") == {"big": "small", "b2": "s2"}
    with pytest.raises(ValueError, match="TARGET=DRAFT"):
        draft_pairs("big")
    with pytest.raises(ValueError, match="LLMD_SPECULATION"):
        load_settings(env={"LLMD_SPECULATION": "fast"})
