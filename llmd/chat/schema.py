"""A tool's JSON schema as decoding can hold it: what the grammar needs, and nothing it would choke on.

Agents' tool schemas are written for validators, not grammars. Three things in them are valid JSON
Schema and still used to refuse whole requests (Claude Code's first request carries all three):
- a bound larger than any reply (`maxLength: 524288`) asks the grammar for half a million rules
  and means the same as no bound: it is dropped, and named (X-LLMD-Ignored);
- a property with no `type` ({"description": ...}) is any JSON value; the converter took it for
  an unknown schema (or, when empty, for an object only): it becomes a union of every JSON type;
- annotations (description, title, examples, default...) change nothing the grammar holds.
The model still sees the tools exactly as sent: this is only the grammar's copy.
"""

from __future__ import annotations

from typing import Any

# a bound over this is no bound: no reply a local model writes comes near it (llama.cpp's grammar
# engine also expands a counted repetition into one rule per link)
MAX_BOUND = 100_000
ANY_VALUE: dict[str, Any] = {"type": ["object", "array", "string", "number", "boolean", "null"]}
_ANNOTATIONS = {"description", "title", "examples", "example", "default", "$comment", "deprecated", "readOnly",
                "writeOnly", "$schema", "$id", "markdownDescription"}
_MAX_BOUNDS = ("maxLength", "maxItems", "maxProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


def loosen(schema: Any, path: str = "") -> tuple[Any, list[str]]:
    """The grammar's copy of `schema`, and what was dropped from it (as JSON paths)."""
    dropped: list[str] = []
    return _loosen(schema, path, dropped), dropped


def _loosen(schema: Any, path: str, dropped: list[str]) -> Any:
    if not isinstance(schema, dict):
        return schema  # true/false, or something the converter will refuse in its own words
    out: dict[str, Any] = {}
    for key, value in schema.items():
        where = f"{path}.{key}" if path else key
        if key in _ANNOTATIONS:
            continue
        if key in _MAX_BOUNDS and isinstance(value, int | float) and value > MAX_BOUND:
            dropped.append(where)
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _loosen(v, f"{where}.{k}", dropped) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_loosen(v, f"{where}[{i}]", dropped) for i, v in enumerate(value)]
        elif key in _SCHEMA_ONE:
            out[key] = (_loosen(value, where, dropped) if isinstance(value, dict) else
                        [_loosen(v, f"{where}[{i}]", dropped) for i, v in enumerate(value)] if isinstance(value, list)
                        else value)
        else:
            out[key] = value
    return out if out else dict(ANY_VALUE)
