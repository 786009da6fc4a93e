"""Long schema bounds are served with flat repetitions; only bounds no context could fill are refused."""

from __future__ import annotations

import pytest

from llmd.backends.llamacpp.sampler import MAX_REPEAT, check_schema_bounds, schema_grammar
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
    ({"type": "string", "maxLength": 30000}, '"\\"" (char){0,30000} "\\""'),
    ({"type": "string", "minLength": 1050, "maxLength": 5000}, "(char){1050,5000}"),
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


def test_short_repetitions_keep_the_nested_form():
    assert "(char (char (char)?)?)?" in schema_grammar({"type": "string", "maxLength": 3})


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
