"""The FIM prompt builder, where a completion ends, and the last-proposal store."""

import asyncio
import dataclasses

import pytest

from llmd.backends.base import FimPrompt, GenerationRequest, Sampling
from llmd.backends.llamacpp.healing import Healer, spend
from llmd.chat.fim import (
    Cut,
    FimTokens,
    cursor_indent,
    fim_tokens,
    healed_fim_tokens,
    middle_start,
    ollama_template,
    spellings_in_vocab,
    typed_since,
)
from llmd.daemon import suggestions
from llmd.daemon.suggestions import Proposal, Suggestions

QWEN = FimTokens(pre=1, suf=2, mid=3, rep=4, sep=5)


def text(t: str) -> list[int]:
    return [ord(c) for c in t]  # one "token" per character, all >= 10


def test_prefix_suffix_middle_in_the_models_order():
    out = fim_tokens(FimPrompt("ab", "cd"), QWEN, text)
    assert out == [1, ord("a"), ord("b"), 2, ord("c"), ord("d"), 3]
    assert fim_tokens(FimPrompt("a", ""), QWEN, text, bos=[0]) == [0, 1, ord("a"), 2, 3]


def test_other_files_come_first_with_the_repo_pattern():
    out = fim_tokens(FimPrompt("x", "y", extra=(("util.py", "K = 1"),)), QWEN, text, filename="main.py")
    assert out[0] == 4 and out.index(5) > 0  # repo, then a file separator and the chunk's name
    rendered = "".join(chr(t) if t >= 10 else f"<{t}>" for t in out)
    assert rendered == "<4>project\n<5>util.py\nK = 1\n<5>main.py\n<1>x<2>y<3>"


def test_without_a_file_separator_chunks_are_headed_as_text():
    plain = FimTokens(pre=1, suf=2, mid=3)
    rendered = "".join(chr(t) if t >= 10 else f"<{t}>" for t in fim_tokens(FimPrompt("x", "", (("a.py", "z"),)),
                                                                             plain, text))
    assert rendered == "\n--- a.py ---\nz\n<1>x<2><3>"


def test_missing_tokens_are_named():
    assert FimTokens(-1, 2, -1).missing == ["FIM prefix", "FIM middle"]
    assert len(spellings_in_vocab(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "x"])) == 3
    assert spellings_in_vocab(["<PRE>", "<SUF>"]) == {"pre": "<PRE>", "suf": "<SUF>"}  # no middle: not FIM
    assert spellings_in_vocab(None) == {}
    t = ollama_template({"pre": "<PRE>", "suf": "<SUF>", "mid": "<MID>"}, "{{ chat }}")
    assert "{{ .Suffix }}" in t and t.endswith("{{ chat }}{{- end }}")


def test_a_completion_ends_at_a_dedent_and_holds_indentation_until_known():
    c = Cut(n_indent=4)
    shown = "".join(c.feed(p, 0.0) for p in ["total = 0", "\n", "    ", "for x in xs:", "\n", "def other():"])
    assert shown == "total = 0\n    for x in xs:" and c.done
    c = Cut(n_indent=4)
    shown = "".join(c.feed(p, 0.0) for p in ["a\n", "  "]) + c.flush()
    assert shown == "a\n  " and not c.done  # the model ended: what was held is shown
    assert cursor_indent("def f():\n        ret") == 8 and cursor_indent("x = 1") == 0


def test_a_time_budget_ends_at_a_complete_line():
    c = Cut(t_max_predict_ms=100)
    assert c.feed("a = 1", 0.0) == "a = 1" and not c.done
    assert c.feed("\nb", 0.2) == "\nb" and c.done


def _req(prefix: str, suffix: str = "\nreturn x\n") -> GenerationRequest:
    return GenerationRequest(id="r", fim=FimPrompt(prefix, suffix), sampling=Sampling(temperature=0.0))


def _done(s: Suggestions, model: str, req: GenerationRequest, text: str) -> Proposal:
    p = s.begin(model, req, [text])
    assert p is not None
    p.finish(True)
    return p


def test_typing_the_proposal_gives_the_rest_of_it():
    async def main() -> None:
        s = Suggestions()
        _done(s, "m", _req("def f(x):\n    "), "x = x + 1")
        assert await s.answer("m", _req("def f(x):\n    x =")) == " x + 1"
        assert await s.answer("m", _req("def f(x):\n    y")) is None  # typed something else
        assert await s.answer("m", _req("def f(x):\n    x = x + 1")) is None  # typed all of it: nothing left
        assert await s.answer("m", _req("def f(x):\n    x", suffix="\n")) is None  # other text after the cursor
        assert await s.answer("other", _req("def f(x):\n    x")) is None
        assert s.stats["answered"] == 1
        p = s.begin("m", _req("a\n"), ["b = 1"])
        assert p is not None
        p.finish(False)  # cut off (cancelled, failed): not an answer
        assert await s.answer("m", _req("a\nb")) is None

    asyncio.run(main())


def test_an_editors_window_that_slid_down_a_line_still_matches():
    old = "".join(f"line {i}\n" for i in range(48)) + "    x ="
    new = "".join(f"line {i}\n" for i in range(1, 48)) + "    x = x + 1\n    y"
    assert typed_since(old, new) == " x + 1\n    y"
    assert typed_since(old, old + "z") == "z"
    assert typed_since("a\nb\nc", "c and more") is None  # most of it gone: another place
    assert typed_since(old, old[:-1]) is None  # deleted: not typing


def test_a_request_joins_the_proposal_still_being_decoded_and_one_that_cannot_cancels_it():
    async def main() -> None:
        s = Suggestions()
        pieces: list[str] = []
        p = s.begin("m", _req("def f(x):\n    "), pieces)
        assert p is not None
        p.run_on(asyncio.ensure_future(asyncio.sleep(60)))  # its editor dropped it; it runs on
        joined = asyncio.ensure_future(s.answer("m", _req("def f(x):\n    re")))
        await asyncio.sleep(0.01)
        assert not joined.done()  # nothing decoded yet: it waits
        pieces.append("ret")
        p.changed()
        await asyncio.sleep(0.01)
        assert not joined.done()
        pieces.append("urn x")
        p.finish(True)
        assert await joined == "turn x"
        # a proposal being decoded that disagrees with what was typed is cancelled for the new request
        q = s.begin("m", _req("def f(x):\n    "), ["y = 2"])
        assert q is not None
        task = asyncio.ensure_future(asyncio.sleep(60))
        q.run_on(task)
        assert await s.answer("m", _req("def f(x):\n    z")) is None
        await asyncio.sleep(0)
        assert task.cancelled()

    asyncio.run(main())


def test_a_dropped_proposal_nobody_asks_for_is_cancelled(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(suggestions, "ORPHAN_S", 0.05)

    async def main() -> None:
        s = Suggestions()
        p = s.begin("m", _req("x = "), [])
        assert p is not None
        task = asyncio.ensure_future(asyncio.sleep(60))
        p.run_on(task)
        await asyncio.sleep(0.2)
        assert task.cancelled()

    asyncio.run(main())


def test_typing_past_the_end_of_a_proposal_is_answered_from_what_was_decoded_on_from_it():
    async def main() -> None:
        s = Suggestions()
        first = _done(s, "m", _req("def f(x):\n    "), "y = x")
        more = s.begin("m", _req("def f(x):\n    y = x"), [" + 1\n    return y"], after=first)
        assert more is not None
        more.finish(True)
        # within the first one: its rest, and what was decoded on from it
        assert await s.answer("m", _req("def f(x):\n    y")) == " = x + 1\n    return y"
        assert await s.answer("m", _req("def f(x):\n    y = x")) == " + 1\n    return y"  # all of it typed
        assert await s.answer("m", _req("def f(x):\n    y = x + 1\n")) == "    return y"
        _done(s, "m", _req("def f(x):\n    "), "z")  # a new proposal there: the chain is gone
        assert await s.answer("m", _req("def f(x):\n    y = x + 1\n")) is None

    asyncio.run(main())


def test_a_request_waiting_for_a_proposal_is_answered_once_its_line_is_complete():
    async def main() -> None:
        s = Suggestions()
        pieces = ["x = 1"]
        p = s.begin("m", _req("def f():\n    "), pieces)
        assert p is not None
        joined = asyncio.ensure_future(s.answer("m", _req("def f():\n    x")))
        await asyncio.sleep(0.01)
        assert not joined.done()  # the line is not complete yet
        pieces.append("\n    y = 2")
        p.changed()
        assert await joined == " = 1\n"  # shown to the end of its line while y's line is still decoded
        assert not p.done

    asyncio.run(main())


def test_the_cursors_line_goes_after_the_middle_less_its_last_token():
    out, healed = healed_fim_tokens(FimPrompt("def f():\n    ret", "\nx"), QWEN, text)
    rendered = "".join(chr(t) if t >= 10 else f"<{t}>" for t in out)
    assert rendered == "<1>def f():\n<2>\nx<3>    re" and healed == ord("t")
    out, healed = healed_fim_tokens(FimPrompt("a = 1\n", "b"), QWEN, text)  # an empty line: nothing to heal
    assert out == fim_tokens(FimPrompt("a = 1\n", "b"), QWEN, text) and healed == -1


def test_healing_allows_tokens_that_begin_with_the_healed_text_or_spell_its_start():
    vocab = [b"", b"re", b"ret", b"return", b"returns", b"rf", b"r", b"\xff", b"\xff\xff", b"x\xff", b"   ", b"    "]
    h = Healer(lambda t: vocab[t], len(vocab))
    assert sorted(h.allowed(b"ret").tolist()) == [1, 2, 3, 4, 6]  # re, ret, return, returns, r
    assert sorted(h.allowed(b"r").tolist()) == [1, 2, 3, 4, 5, 6]
    assert sorted(h.allowed(b"\xff").tolist()) == [7, 8]
    assert sorted(h.allowed(b"x").tolist()) == [9]
    assert sorted(h.allowed(b"    ").tolist()) == [10, 11]  # Qwen spells "    return" as "   " + " return"
    assert h.allowed(b"zz").tolist() == []


def test_the_healed_text_is_spent_by_the_tokens_that_spell_it_and_not_shown():
    assert spend(b"    ", b"   ") == (b" ", b"")
    assert spend(b" ", b" return") == (b"", b"return")
    assert spend(b"ret", b"return") == (b"", b"urn")


def test_lines_typed_since_a_slots_prompt_stay_after_the_middle():
    head = "import os\n\ndef f():\n"
    fim = FimPrompt(head + "    x = 1\n    return x", "\nprint(f())\n")
    assert middle_start(fim, []) == len(head + "    x = 1\n")  # no slot typed into: the cursor's line
    assert middle_start(fim, [head]) == len(head)  # the typed lines stay after the middle token
    slid = FimPrompt(fim.prefix[len("import os\n"):], fim.suffix)  # the editor's window slid a line
    assert middle_start(slid, [head]) == len(head) - len("import os\n")
    assert middle_start(fim, ["elsewhere\n"]) == len(head + "    x = 1\n")
    many = FimPrompt(head + "    x = 1\n" * 20, "")
    assert middle_start(many, [head]) == len(many.prefix)  # too many lines since: start again
    out, healed = healed_fim_tokens(fim, QWEN, text, cut=len(head))
    assert "".join(chr(t) for t in out if t >= 10).endswith("\nprint(f())\n    x = 1\n    return ")


def test_what_a_client_hangs_up_on_is_learned_for_that_client_only():
    s = Suggestions()
    for _ in range(suggestions.MIN_DROPS):
        s.dropped("m", "vscode/1", 0.5)
    assert s.reply_within("m", "vscode/1") == pytest.approx(0.5 * suggestions.REPLY_SHARE)
    assert s.reply_within("m", "curl/8") is None  # another client's requests are not cut by it
    assert s.reply_within("other", "vscode/1") is None
    assert list(s.reply_times()["m"]) == ["vscode/1"]


def test_a_proposal_answers_only_requests_whose_reply_it_would_be():
    async def main() -> None:
        s = Suggestions()
        _done(s, "m", _req("def f(x):\n    "), "x = x + 1")
        longer = dataclasses.replace(_req("def f(x):\n    x"), max_tokens=5)  # another reply
        assert await s.answer("m", longer) is None
        with_logprobs = dataclasses.replace(_req("def f(x):\n    x"), top_logprobs=2)
        assert s.begin("m", with_logprobs, ["y"]) is None  # a proposal holds no log probabilities
        assert await s.answer("m", _req("def f(x):\n    x")) == " = x + 1"

    asyncio.run(main())


def test_a_chain_of_continuations_is_capped_and_the_store_by_bytes():
    s = Suggestions()
    p = _done(s, "m", _req("a\n"), "b")
    links = 0
    while (p := s.begin("m", _req("a\nb"), ["c"], after=p)) is not None:  # type: ignore[assignment]
        links += 1
    assert links == suggestions.MAX_LINKS - 1  # decoded on from where it stopped a bounded number of times
    big = "x" * (suggestions.MAX_BYTES // 3)
    for i in range(6):
        _done(s, "m", _req(f"{i}{big}"), "y")
    assert s.held_bytes() <= suggestions.MAX_BYTES + len(big) + 10


def test_a_dropped_proposal_runs_on_as_background_work_until_a_keystroke_asks_for_it():
    """Decoded for nobody, a proposal must not go ahead of a chat or an agent on the CPU board
    (llmd.priority); a keystroke's request that joins it makes it interactive again."""
    async def main() -> None:
        s = Suggestions()
        seen: list[tuple[str, str, str]] = []
        s.on_priority = lambda model, rid, cls: seen.append((model, rid, cls))
        pieces: list[str] = []
        p = s.begin("m", _req("def f(x):\n    "), pieces)
        assert p is not None
        p.run_on(asyncio.ensure_future(asyncio.sleep(60)))
        assert seen == [("m", "r", "background")]
        joined = asyncio.ensure_future(s.answer("m", _req("def f(x):\n    re")))
        await asyncio.sleep(0.01)
        assert seen[-1] == ("m", "r", "interactive")
        pieces.append("return x")
        p.finish(True)
        assert await joined == "turn x"
        p.cancel()

    asyncio.run(main())
