"""GBNF grammars for llama.cpp from JSON schemas, regular-expression patterns and tool constraints,
bounded by what one request may ask of llama.cpp's grammar parser.

llama-cpp-python's schema converter writes a bounded repetition as nested optional groups,
"(c (c (c)?)?)?", and llama.cpp's grammar parser recurses once per group: maxLength 30000 (or a
pattern like a{0,50000}) overflowed the worker's stack. llmd writes every bounded repetition
itself, with GBNF's own counted form c{0,30000}, which llama.cpp expands into a chain of rules
without recursing (each link a tail call while sampling): the bound is enforced by the grammar
to the character. `_Converter` does that for strings and arrays and translates patterns with its
own parser; the rest of the schema (objects, unions, refs, formats) is llama-cpp-python's.

What a request may ask for is bounded before any of it reaches llama.cpp: each bound up to
MAX_REPEAT, all of one request's bounds together up to REPEAT_BUDGET (each counted repetition
becomes that many rules, built on the worker's step thread), a counted repetition of something
that can match nothing up to MAX_EMPTY_REPEAT, and nesting up to MAX_DEPTH.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from llmd.backends.llamacpp.grammar_cost import MAX_STACKS, grammar_cost
from llmd.chat.schema import MAX_BOUND, loosen
from llmd.chat.tools import MAX_PARALLEL_CALLS, ToolConstraint
from llmd.errors import GrammarError

log = logging.getLogger("llmd.grammar")

MAX_REPEAT = MAX_BOUND  # one bound; a larger upper bound is dropped before this (chat.schema.loosen)
REPEAT_BUDGET = 2 * MAX_BOUND  # every bound of one request's schema together
MAX_EMPTY_REPEAT = MAX_STACKS  # (a?){0,N}: llama.cpp holds a parse stack per empty link (grammar_cost)
MAX_DEPTH = 32
MAX_PATTERN = 4096  # characters of one pattern
_REPEAT_KEYS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties")

# llama-cpp-python's char rule lets a JSON string hold raw control characters (a newline), which
# makes the output invalid JSON; JSON forbids them, as llama.cpp's own converter does
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


# ---- regular-expression patterns ------------------------------------------------------------


@dataclass
class _Alt:
    """Alternatives, each a sequence of items."""
    seqs: list[list[_Item]]


@dataclass
class _Item:
    """One atom (a GBNF fragment for a character or class, or a group) and how often it repeats."""
    atom: str | _Alt
    lo: int = 1
    hi: int | None = 1
    can_be_empty: bool = False  # the atom itself can match nothing (a group like (a?) or (|b))


_CLASS_ESCAPES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r"}
_QUANT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")


def _gbnf_literal(c: str) -> str:
    """A GBNF literal for one character as it is written inside a JSON string."""
    return json.dumps(json.dumps(c, ensure_ascii=False)[1:-1], ensure_ascii=False)


@dataclass
class _Pattern:
    """A recursive-descent parser for the regular expressions JSON schemas use (ECMA 262's common
    subset: literals, escapes, classes, ., groups, alternation, ?, *, +, {m}, {m,}, {m,n}, and ^ $
    at the ends). Lookarounds, backreferences and lazy quantifiers are refused."""
    text: str
    i: int = 0
    items: list[_Item] = field(default_factory=list)  # every item parsed, for the bounds check
    depth: int = 0  # groups open at the current position (the parser recurses once per group)

    def parse(self) -> _Alt:
        t = self.text
        if t.startswith("^"):
            self.i = 1
        alt = self._alt()
        if self.i < len(t) and t[self.i:] == "$":
            self.i += 1
        if self.i != len(t):
            raise ValueError(f"unexpected {t[self.i]!r} at {self.i}")
        return alt

    def _alt(self) -> _Alt:
        seqs = [self._seq()]
        while self.i < len(self.text) and self.text[self.i] == "|":
            self.i += 1
            seqs.append(self._seq())
        return _Alt(seqs)

    def _seq(self) -> list[_Item]:
        seq: list[_Item] = []
        t = self.text
        while self.i < len(t) and t[self.i] not in "|)":
            if t[self.i] == "$" and self.i == len(t) - 1:
                break
            item = self._atom()
            self._quantifier(item)
            seq.append(item)
            self.items.append(item)
        return seq

    def _atom(self) -> _Item:
        t, c = self.text, self.text[self.i]
        if c == "(":
            self.i += 1
            if t.startswith("?:", self.i):
                self.i += 2
            elif t.startswith("?", self.i):
                raise ValueError("lookarounds and named groups are not supported")
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ValueError(f"groups nest deeper than {MAX_DEPTH} levels at {self.i}")
            alt = self._alt()
            self.depth -= 1
            if self.i >= len(t) or t[self.i] != ")":
                raise ValueError("a group is not closed")
            self.i += 1
            return _Item(alt, can_be_empty=_nullable(alt))
        if c == "[":
            end = self.i + 1
            if t.startswith("^", end):
                end += 1
            if t.startswith("]", end):
                end += 1
            while end < len(t) and t[end] != "]":
                end += 2 if t[end] == "\\" else 1
            if end >= len(t):
                raise ValueError("a character class is not closed")
            body, self.i = t[self.i + 1:end], end + 1
            return _Item(_char_class(body))
        if c == ".":
            self.i += 1
            return _Item("char")  # any character a JSON string holds, escaped as JSON escapes it
        if c == "\\":
            if self.i + 1 >= len(t):
                raise ValueError("a pattern ends with a backslash")
            e = t[self.i + 1]
            self.i += 2
            if e.lower() in _CLASS_ESCAPES:
                chars = _CLASS_ESCAPES[e.lower()]
                return _Item(f"[{chars}]" if e.islower() else f'[^{chars}"\\\\\\x00-\\x1F]')
            if e.isdigit() or e in "bBkpP":
                raise ValueError(f"\\{e} is not supported")
            return _Item(_gbnf_literal({"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}.get(e, e)))
        if c in "*+?{":
            raise ValueError(f"nothing to repeat at {self.i}")
        self.i += 1
        return _Item(_gbnf_literal(c))

    def _quantifier(self, item: _Item) -> None:
        t = self.text
        if self.i >= len(t):
            return
        c = t[self.i]
        if c in "?*+":
            item.lo, item.hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}[c]
            self.i += 1
        elif c == "{" and (m := _QUANT.match(t, self.i)):
            lo = int(m.group(1))
            hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
            if hi is not None and hi < lo:
                raise ValueError(f"{m.group(0)} repeats at most fewer times than at least")
            item.lo, item.hi = lo, hi
            self.i = m.end()
        else:
            return
        if self.i < len(t) and t[self.i] in "?+":
            raise ValueError("lazy and possessive quantifiers are not supported")


def _nullable(alt: _Alt) -> bool:
    return any(all(it.lo == 0 or it.can_be_empty for it in seq) for seq in alt.seqs)


def _char_class(body: str) -> str:
    """A regex class as a GBNF one; a negated class also leaves out what a JSON string cannot hold raw."""
    neg = body.startswith("^")
    out, i = [], 1 if neg else 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            e = body[i + 1]
            if e.lower() in _CLASS_ESCAPES and e.islower():
                out.append(_CLASS_ESCAPES[e])
            elif e in "ntrfv":
                out.append("\\" + e if e in "ntr" else {"f": "\\x0C", "v": "\\x0B"}[e])
            else:
                out.append("\\" + e if e in "]\\^-[" else e)
            i += 2
            continue
        out.append("\\" + c if c in '"' else c)
        i += 1
    chars = "".join(out)
    return f'[^{chars}"\\\\\\x00-\\x1F]' if neg else f"[{chars}]"


def _repeat(item: str, lo: int, hi: int | None, sep: str = "") -> str:
    """`item` repeated lo..hi times (hi None: no upper bound), `sep` between items, in GBNF's own
    counted form: llama.cpp expands it into a chain of rules without recursing."""
    if hi == 0:
        return ""
    if not sep:
        atom = _one_atom(item)
        if (lo, hi) == (0, 1):
            return f"{atom}?"
        if hi is None:
            return f"{atom}{{{lo},}}" if lo > 1 else f"{atom}{'+' if lo else '*'}"
        return f"{atom}{{{lo},{hi}}}" if lo != hi else f"{atom}{{{lo}}}"
    rest = _repeat(f"{sep} {item}", max(0, lo - 1), None if hi is None else hi - 1)
    once = f"{item} {rest}".rstrip()
    return once if lo > 0 else f"({once})?"


_NAME_OR_CLASS = re.compile(r"[A-Za-z0-9_-]+|\[(?:[^\]\\]|\\.)*\]")


def _one_atom(item: str) -> str:
    """`item` as one GBNF atom: a name, a class or a group as it is, anything else in parentheses
    (each group is a rule to llama.cpp, counted against its repetition limit: never two for one)."""
    if _NAME_OR_CLASS.fullmatch(item):
        return item
    if item.startswith("(") and item.endswith(")"):
        depth = 0
        for i, c in enumerate(item):  # is the first parenthesis closed only at the end?
            depth += (c == "(") - (c == ")")
            if depth == 0:
                if i == len(item) - 1 and '"' not in item:
                    return item
                break
    return f"({item})"


def _gbnf(alt: _Alt) -> str:
    def item(it: _Item) -> str:
        atom = it.atom if isinstance(it.atom, str) else f"({_gbnf(it.atom)})"
        return atom if (it.lo, it.hi) == (1, 1) else _repeat(atom, it.lo, it.hi)
    return " | ".join(" ".join(item(it) for it in seq) or '""' for seq in alt.seqs)


def _parse_pattern(pattern: str, path: str, field_name: str) -> _Pattern:
    p = _Pattern(pattern)
    try:
        p.parse()
    except ValueError as e:
        raise GrammarError(f"{path}.pattern {pattern!r} cannot be held by a grammar: {e}", field_name) from None
    return p


# ---- bounds ------------------------------------------------------------------------------------


@dataclass
class _Budget:
    field_name: str
    used: int = 0

    def spend(self, n: int, where: str) -> None:
        self.used += n
        if self.used > REPEAT_BUDGET:
            raise GrammarError(f"the schema's repetition bounds add up to {self.used:,} at {where}; llmd holds one "
                               f"request's schema to {REPEAT_BUDGET:,} in all (each becomes that many grammar rules): "
                               "leave out bounds no reply could reach", self.field_name)


def check_schema_bounds(schema: Any, path: str = "schema", field_name: str = "response_format") -> None:
    """Refuse, with the limit, a JSON schema whose grammar would be too deep, repeat too much, or
    ask for more rules in all than one request may."""
    _check(schema, path, 0, _Budget(field_name))


def _check(schema: Any, path: str, depth: int, budget: _Budget) -> None:
    f = budget.field_name
    if depth > MAX_DEPTH:
        raise GrammarError(f"the JSON schema nests deeper than {MAX_DEPTH} levels at {path}; flatten it", f)
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in _REPEAT_KEYS and isinstance(value, int | float) and not isinstance(value, bool):
                if value > MAX_REPEAT:
                    raise GrammarError(f"{path}.{key} is {value}; llmd enforces schemas with bounds up to {MAX_REPEAT} "
                                       "(more than any context holds: leave the bound out)", f)
                budget.spend(int(value), f"{path}.{key}")
            if key == "pattern" and isinstance(value, str):
                if len(value) > MAX_PATTERN:
                    raise GrammarError(f"{path}.pattern is {len(value):,} characters; llmd enforces patterns of up to "
                                       f"{MAX_PATTERN:,}", f)
                for it in _parse_pattern(value, path, f).items:
                    n = max(it.lo, it.hi or 0)
                    if n > MAX_REPEAT:
                        raise GrammarError(f"{path}.pattern repeats {n} times; llmd enforces patterns with "
                                           f"repetitions up to {MAX_REPEAT}", f)
                    if it.can_be_empty and n > MAX_EMPTY_REPEAT:
                        raise GrammarError(f"{path}.pattern repeats a group that can match nothing {n} times; llmd "
                                           f"allows up to {MAX_EMPTY_REPEAT} (write the group so it always matches "
                                           "something)", f)
                    if n > 1:
                        budget.spend(n, f"{path}.pattern")
            _check(value, f"{path}.{key}", depth + 1, budget)
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            _check(item, f"{path}[{i}]", depth + 1, budget)


# ---- schemas -----------------------------------------------------------------------------------


def _converter() -> Any:
    """llama-cpp-python's SchemaConverter with llmd's strings, arrays and patterns (flat counted
    repetitions, its own pattern translation); everything else is the converter's own."""
    from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, STRING_FORMAT_RULES, SchemaConverter

    class Converter(SchemaConverter):
        def visit(self, schema: dict[str, Any], name: str) -> str:
            # the converter's own order of cases, so that every case that writes a repetition is
            # llmd's (flat, counted) whatever other keys the schema carries
            kind, fmt = schema.get("type"), schema.get("format")
            rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
            if (any(k in schema for k in ("$ref", "oneOf", "anyOf", "const", "enum")) or isinstance(kind, list)
                    or (kind in (None, "object") and ("properties" in schema or "allOf" in schema or (
                        "additionalProperties" in schema and schema["additionalProperties"] is not True)))):
                return str(super().visit(schema, name))
            if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
                items = schema.get("items") or schema["prefixItems"]
                if not isinstance(items, dict):
                    return str(super().visit(schema, name))  # a tuple: one rule per item, no repetition
                item_rule = self.visit(items, f"{name}{'-' if name else ''}item")
                body = _repeat(item_rule, int(schema.get("minItems", 0)), _int(schema.get("maxItems")), '"," space')
                return str(self._add_rule(rule_name, f'"[" space {body} "]" space'.replace("  ", " ")))
            if kind in (None, "string") and "pattern" in schema:
                if not isinstance(schema["pattern"], str):
                    raise GrammarError("a schema's pattern must be a string", "response_format")
                self._add_primitive("char", PRIMITIVE_RULES["char"])  # `.` is any JSON string character
                alt = _Pattern(schema["pattern"]).parse()
                return str(self._add_rule(rule_name, f'"\\"" ({_gbnf(alt)}) "\\"" space'))
            formatted = isinstance(fmt, str) and (re.match(r"^uuid[1-5]?$", fmt)
                                                  or f"{fmt}-string" in STRING_FORMAT_RULES)
            if kind == "string" and not formatted and ("minLength" in schema or "maxLength" in schema):
                char = self._add_primitive("char", PRIMITIVE_RULES["char"])
                body = _repeat(char, int(schema.get("minLength", 0)), _int(schema.get("maxLength")))
                return str(self._add_rule(rule_name, f'"\\"" {body} "\\"" space'))
            return str(super().visit(schema, name))

    return Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _int(v: Any) -> int | None:
    return None if v is None else int(v)


def schema_grammar(schema: Any, field_name: str = "response_format") -> str:
    """GBNF for a JSON schema, with JSON's own string rules."""
    conv = _converter()
    try:
        conv.visit(conv.resolve_refs(schema, "request"), "")
        gbnf = conv.format_grammar()
    except GrammarError:
        raise
    except Exception as e:  # the converter raises bare Exceptions on unsupported schemas
        raise GrammarError(f"cannot turn this JSON schema into a grammar: {e}", field_name) from None
    gbnf = str(gbnf).replace(_LOOSE_CHAR, _JSON_CHAR)
    grammar_cost(gbnf, field_name)  # whatever wrote it, llama.cpp gets nothing it would choke on
    return gbnf


def grammar_for(response_format: dict[str, Any] | None) -> str | None:
    """GBNF for an OpenAI-style response_format ({"type": "json_object" | "json_schema" | "text"})."""
    if not response_format or response_format.get("type", "text") == "text":
        return None
    from llama_cpp.llama_grammar import JSON_GBNF

    kind = response_format.get("type")
    if kind == "json_object":
        schema = response_format.get("schema")
        if schema:
            schema = loosen(schema)[0]
            check_schema_bounds(schema)
        return schema_grammar(schema) if schema else str(JSON_GBNF)
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema.schema must be a JSON schema object", "response_format")
        schema = loosen(schema)[0]
        check_schema_bounds(schema)
        return schema_grammar(schema)
    raise GrammarError(
        f"response_format.type {kind!r} is not supported; use text, json_object or json_schema", "response_format"
    )


def _literal(text: str) -> str:
    return json.dumps(text)  # a GBNF string literal escapes as JSON does, for the text we write


def grammar_for_tools(c: ToolConstraint) -> str:
    """GBNF for a tool constraint: prefix, a JSON value matching the schema, suffix (repeated for
    parallel calls). The schema comes from the request's tools, so it is bounded like any other; a
    tools' schema the converter cannot take, or that asks too much, holds only the call's name and
    JSON shape (the tools are the app's, not the user's: the request is served, never refused for
    them)."""
    try:
        check_schema_bounds(c.schema, "tools", "tools")
        body = schema_grammar(c.schema, "tools")
    except GrammarError as e:
        if c.fallback is None:
            raise
        log.warning("tool arguments held to their JSON shape only: %s", e.message)
        body = schema_grammar(c.fallback, "tools")
    body = re.sub(r"^root ::=", "llmd-call ::=", body, flags=re.M)
    block = " ".join(p for p in (_literal(c.prefix) if c.prefix else "", "llmd-call",
                                 _literal(c.suffix) if c.suffix else "") if p)
    root = f"root ::= {block}" + (f' ("\\n" {block}){{0,{MAX_PARALLEL_CALLS - 1}}}' if c.repeat else "")
    gbnf = root + "\n" + body
    grammar_cost(gbnf, "tools")
    return gbnf
