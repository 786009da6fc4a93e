"""Native llama.cpp sampler chains, one per request: no Python-side sampling in the hot path."""

from __future__ import annotations

import ctypes
import json
import logging
import random
import re
from typing import Any

from llmd.backends.base import Sampling
from llmd.chat.schema import MAX_BOUND, loosen
from llmd.chat.tools import MAX_PARALLEL_CALLS, ToolConstraint
from llmd.errors import GrammarError

log = logging.getLogger("llmd.grammar")

# llama-cpp-python's schema converter writes a bounded repetition as nested optional groups,
# "(c (c (c)?)?)?", and llama.cpp's grammar parser recurses once per group: maxLength 30000 (or a
# pattern like a{0,50000}) overflowed the worker's stack. So repetitions longer than FLAT_OVER are
# written with GBNF's own counted repetition, c{0,30000}, which llama.cpp expands into a chain of
# rules without recursing (and whose stacks stay flat while sampling, each link a tail call): the
# bound is then enforced by the grammar itself, to the character. MAX_REPEAT only stops a schema
# from asking for more rules than any context could fill.
FLAT_OVER = 32
MAX_REPEAT = MAX_BOUND  # a larger upper bound is dropped before this (chat.schema.loosen)
MAX_DEPTH = 32
_REPEAT_KEYS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties")
_QUANT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def check_schema_bounds(schema: Any, path: str = "schema", depth: int = 0) -> None:
    """Refuse, with the limit, a JSON schema whose grammar would be too deep or repeat too much."""
    if depth > MAX_DEPTH:
        raise GrammarError(f"the JSON schema nests deeper than {MAX_DEPTH} levels at {path}; flatten it",
                           "response_format")
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in _REPEAT_KEYS and isinstance(value, int | float) and value > MAX_REPEAT:
                raise GrammarError(f"{path}.{key} is {value}; llmd enforces schemas with bounds up to {MAX_REPEAT} "
                                   "(more than any context holds: leave the bound out)", "response_format")
            if key == "pattern" and isinstance(value, str):
                for m in _QUANT.finditer(value):
                    n = max(int(m.group(1)), int(m.group(2) or 0))
                    if n > MAX_REPEAT:
                        raise GrammarError(f"{path}.pattern repeats {n} times ({m.group(0)}); llmd enforces "
                                           f"patterns with repetitions up to {MAX_REPEAT}", "response_format")
            check_schema_bounds(value, f"{path}.{key}", depth + 1)
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema_bounds(item, f"{path}[{i}]", depth + 1)


# llama-cpp-python's schema converter lets a JSON string hold raw control characters (a newline),
# which makes the output invalid JSON; JSON forbids them, as llama.cpp's own converter does
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


def _flat_repetition(item_rule: str, min_items: int, max_items: int | None, separator_rule: str | None = None,
                     item_rule_is_literal: bool = False) -> str:
    """llama-cpp-python's _build_repetition, with long bounded repetitions in GBNF's x{m,n} form."""
    if max_items is None or max(min_items, max_items - min_items) <= FLAT_OVER:
        return _nested_repetition(item_rule, min_items, max_items, separator_rule, item_rule_is_literal)
    if not separator_rule:
        return f"({item_rule}){{{min_items},{max_items}}}"
    rest = f"({separator_rule} {item_rule}){{{max(0, min_items - 1)},{max_items - 1}}}"
    return f"{item_rule} {rest}" if min_items > 0 else f"({item_rule} {rest})?"


_nested_repetition: Any = None


def _use_flat_repetition() -> None:
    """Point the converter at _flat_repetition (it looks _build_repetition up at each call)."""
    global _nested_repetition
    from llama_cpp import llama_grammar

    if _nested_repetition is None:
        _nested_repetition = llama_grammar._build_repetition
        llama_grammar._build_repetition = _flat_repetition


def schema_grammar(schema: Any, field: str = "response_format") -> str:
    """GBNF for a JSON schema, with JSON's own string rules."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    _use_flat_repetition()
    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises bare Exceptions on unsupported schemas
        raise GrammarError(f"cannot turn this JSON schema into a grammar: {e}", field) from None
    return gbnf.replace(_LOOSE_CHAR, _JSON_CHAR)


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
        return schema_grammar(schema) if schema else JSON_GBNF
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
    tools' schema the converter cannot take holds only the call's name and JSON shape (the tools are
    the app's, not the user's: the request is served, never refused for them)."""
    try:
        check_schema_bounds(c.schema, "tools")
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
    return root + "\n" + body


class SamplerChain:
    """Owns a llama_sampler chain; `sample(ctx, i)` samples and accepts the token of output row i."""

    def __init__(self, vocab: Any, n_vocab: int, sampling: Sampling, grammar: str | None, trigger: str = "") -> None:
        """`trigger`: the grammar is lazy, applied from the first occurrence of this text on."""
        import llama_cpp as L

        self._L = L
        params = L.llama_sampler_chain_default_params()
        params.no_perf = True
        self.chain = L.llama_sampler_chain_init(params)
        add = lambda s: L.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if grammar is not None:
            if trigger:
                # llama.cpp matches the pattern against all text so far; the grammar is fed from group 1
                pattern = (ctypes.c_char_p * 1)(f"[\\s\\S]*?({re.escape(trigger)})[\\s\\S]*".encode())
                g = L.llama_sampler_init_grammar_lazy_patterns(vocab, grammar.encode(), b"root", pattern, 1, None, 0)
            else:
                g = L.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not g:
                self.close()
                raise GrammarError("the grammar for response_format did not parse", "response_format")
            add(g)
        s = sampling
        if s.presence_penalty or s.frequency_penalty or s.repeat_penalty != 1.0:
            add(L.llama_sampler_init_penalties(n_vocab, 64, s.repeat_penalty, s.frequency_penalty, s.presence_penalty))
        if s.greedy:
            add(L.llama_sampler_init_greedy())
            return
        if s.top_k > 0:
            add(L.llama_sampler_init_top_k(s.top_k))
        if s.top_p < 1.0:
            add(L.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0.0:
            add(L.llama_sampler_init_min_p(s.min_p, 1))
        add(L.llama_sampler_init_temp(s.temperature))
        seed = s.seed if s.seed is not None else random.getrandbits(32)
        add(L.llama_sampler_init_dist(seed % 0xFFFFFFFF))  # 0xFFFFFFFF would mean 'random'

    def sample(self, ctx: Any, row: int) -> int:
        return int(self._L.llama_sampler_sample(self.chain, ctx, row))

    def close(self) -> None:
        if self.chain:
            self._L.llama_sampler_free(self.chain)
            self.chain = None


def token_logprobs(ctx: Any, row: int, token: int, n_vocab: int, top: int,
                   text_of: Any) -> tuple[str, float, tuple[tuple[str, float], ...]]:
    """The model's log-probability of `token` at output row `row` (from the raw logits, before
    temperature and penalties, as OpenAI reports them) and the `top` most likely tokens."""
    import llama_cpp as L
    import numpy as np

    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(n_vocab,)).astype(np.float64)
    peak = logits.max()
    logz = peak + np.log(np.exp(logits - peak).sum())
    best: tuple[tuple[str, float], ...] = ()
    if top > 0:
        idx = np.argpartition(-logits, top)[:top]
        idx = idx[np.argsort(-logits[idx])]
        best = tuple((text_of(int(i)), float(logits[i] - logz)) for i in idx)
    return text_of(token), float(logits[token] - logz), best
