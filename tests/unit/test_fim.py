"""The FIM prompt builder, where a completion ends, and the last-proposal store."""

from llmd.backends.base import FimPrompt, GenerationRequest, Sampling
from llmd.chat.fim import Cut, FimTokens, cursor_indent, fim_tokens, ollama_template, spellings_in_vocab
from llmd.daemon.suggestions import Suggestions

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


def test_typing_the_proposal_gives_the_rest_of_it():
    s = Suggestions()
    s.put("m", _req("def f(x):\n    "), "x = x + 1")
    assert s.get("m", _req("def f(x):\n    x =")) == " x + 1"
    assert s.get("m", _req("def f(x):\n    y")) is None  # typed something else
    assert s.get("m", _req("def f(x):\n    x = x + 1")) is None  # typed all of it: nothing left
    assert s.get("m", _req("def f(x):\n    x", suffix="\n")) is None  # other text after the cursor
    assert s.get("other", _req("def f(x):\n    x")) is None
    assert s.hits == 1
