"""Schemas whose grammar would overflow llama.cpp's parser are refused before it sees them."""

from __future__ import annotations

import pytest

from llmd.backends.llamacpp.sampler import MAX_REPEAT, check_schema_bounds
from llmd.errors import GrammarError


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 30000},
    {"type": "string", "pattern": "^a{0,50000}$"},
    {"type": "string", "pattern": "^a{3000}$"},
    {"type": "object", "properties": {"xs": {"type": "array", "maxItems": 5000}}},
])
def test_large_bounds_are_refused_with_the_limit(schema: dict):
    with pytest.raises(GrammarError, match=str(MAX_REPEAT)):
        check_schema_bounds(schema)


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
