"""Schema bounds are served with flat counted repetitions written by llmd (no patch of llama-cpp-python's
converter); bounds no context could fill, a request's bounds past their joint budget, and long
repetitions of what can match nothing are refused with the limit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmd.backends.llamacpp.grammar import (
    MAX_EMPTY_REPEAT,
    MAX_REPEAT,
    REPEAT_BUDGET,
    check_schema_bounds,
    grammar_for_tools,
    schema_grammar,
)
from llmd.chat.tools import ToolConstraint
from llmd.errors import GrammarError


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 300_000},
    {"type": "string", "pattern": "^a{0,500000}$"},
    {"type": "object", "properties": {"xs": {"type": "array", "maxItems": 5_000_000}}},
])
def test_bounds_no_context_could_fill_are_refused_with_the_limit(schema: dict):
    with pytest.raises(GrammarError, match=f"{MAX_REPEAT}"):
        check_schema_bounds(schema)


@pytest.mark.parametrize("schema, flat", [
    ({"type": "string", "maxLength": 30000}, '"\\"" char{0,30000} "\\""'),
    ({"type": "string", "minLength": 1050, "maxLength": 5000}, "char{1050,5000}"),
    ({"type": "string", "pattern": "^a{0,50000}$"}, '("a"){0,50000}'),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 5000}, '(integer ("," space integer){0,4999})?'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2000, "maxItems": 5000},
     'integer ("," space integer){1999,4999}'),
])
def test_long_repetitions_are_written_flat_not_nested(schema: dict, flat: str):
    """A bound over 1000 used to be refused (the nested form overflowed llama.cpp's parser); now it
    is GBNF's counted repetition, which llama.cpp expands without recursing."""
    check_schema_bounds(schema)
    gbnf = schema_grammar(schema)
    assert flat.replace("\\\\", "\\") in gbnf, gbnf[:400]
    assert "(char (char" not in gbnf and '("a" ("a"' not in gbnf


def test_short_repetitions_are_counted_too_and_the_converter_is_not_patched():
    import llama_cpp.llama_grammar as lg

    assert "char{0,3}" in schema_grammar({"type": "string", "maxLength": 3})
    # llama-cpp-python's own converter is left as it is: its nested form for everyone else
    assert lg._build_repetition("c", 0, 3) == "(c (c (c)?)?)?"


def test_one_requests_bounds_share_one_budget():
    """Each bound may be 100,000, but hundreds of them in one body asked llama.cpp for tens of
    millions of rules on the worker's step thread."""
    props = {f"p{i}": {"type": "string", "maxLength": 100_000} for i in range(300)}
    with pytest.raises(GrammarError, match=f"{REPEAT_BUDGET:,}"):
        check_schema_bounds({"type": "object", "properties": props})
    check_schema_bounds({"type": "object", "properties": dict(list(props.items())[:2])})


@pytest.mark.parametrize("pattern", ["^(a?){0,100000}$", "^(a|){0,5000}$", "^(?:(x)*){2000}$", "^(b?c?){1001,}$"])
def test_long_repetitions_of_what_can_match_nothing_are_refused(pattern: str):
    with pytest.raises(GrammarError, match=f"can match nothing .* up to {MAX_EMPTY_REPEAT}"):
        check_schema_bounds({"type": "string", "pattern": pattern})


def test_a_tool_schema_past_the_budget_is_held_to_its_shape_and_served():
    props = {f"p{i}": {"type": "string", "maxLength": 100_000} for i in range(3)}
    c = ToolConstraint(prefix="<tool_call>", suffix="</tool_call>", schema={"type": "object", "properties": props},
                       fallback={"type": "object"})
    gbnf = grammar_for_tools(c)
    assert "100000" not in gbnf and "llmd-call ::=" in gbnf


@pytest.mark.parametrize("pattern, ok, bad", [
    ("^[a-z]{2,4}-\\d{3}$", ["ab-123", "abcd-000"], ["a-123", "ab-12", "AB-123"]),
    ("^(foo|ba[rz])+$", ["foo", "barbazfoo"], ["", "fob"]),
    ("^a.c$", ["abc", "a c", 'a\\"c'], ["ac", 'a"c']),
    ("^x{3}$", ["xxx"], ["xx", "xxxx"]),
    ("^(?:ab)?c*$", ["", "ab", "abccc", "c"], ["a", "abab"]),
    ("[^a]b", ["xb", "zb"], ["ab", '"b']),
])
def test_patterns_become_grammars_llama_cpp_holds_to_the_letter(pattern: str, ok: list[str], bad: list[str]):
    """llmd's own pattern translation: llama.cpp's parser takes the grammar, and its language, read
    as a regular expression (these grammars do not recurse), holds each string as the JSON it would
    be written as, quotes included."""
    gbnf = schema_grammar({"type": "string", "pattern": pattern})
    assert _llama_cpp_parses(gbnf), gbnf
    rx = re.compile(_as_regex(gbnf) + r"\Z")
    for text in ok:
        assert rx.match('"' + text + '"'), (pattern, text, gbnf)
    for text in bad:
        assert not rx.match('"' + text + '"'), (pattern, text, gbnf)


def _as_regex(gbnf: str) -> str:
    """A non-recursive GBNF grammar as a Python regular expression for its root rule."""
    rules = dict(line.split(" ::= ", 1) for line in gbnf.splitlines())
    token = re.compile(r'"((?:[^"\\]|\\.)*)"|(\[(?:[^\]\\]|\\.)*\])|([a-z][a-z0-9-]*)|(\{\d+(?:,\d*)?\}|[()|?*+])|\s+')

    def expand(body: str) -> str:
        out = []
        for m in token.finditer(body):
            lit, cls, ref, op = m.groups()
            if lit is not None:
                out.append(re.escape(json.loads('"' + lit + '"')))
            elif cls is not None:
                out.append(cls.replace("\\x", "\\x"))
            elif ref is not None:
                out.append("(?:" + expand(rules[ref]) + ")")
            elif op is not None:
                out.append("(?:" if op == "(" else op)
        return "".join(out)
    return expand(rules["root"])


def _llama_cpp_parses(gbnf: str) -> bool:
    import llama_cpp as L

    from llmd.models.catalog import find_packaged

    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(find_packaged(Path("/tmp"))["smollm2-135m"]).encode(), params)
    try:
        s = L.llama_sampler_init_grammar(L.llama_model_get_vocab(model), gbnf.encode(), b"root")
        if s:
            L.llama_sampler_free(s)
        return bool(s)
    finally:
        L.llama_model_free(model)


def test_deep_nesting_is_refused():
    schema: dict = {"type": "string"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError, match="nests deeper"):
        check_schema_bounds(schema)


def test_ordinary_schemas_pass():
    check_schema_bounds({"type": "object", "properties": {"name": {"type": "string", "maxLength": 100},
                                                          "tags": {"type": "array", "maxItems": 10}},
                         "required": ["name"]})
