"""Any JSON schema or pattern a client sends either becomes a grammar llama.cpp's own parser loads,
within llmd's cost bounds and accepting the schema's valid instances, or is refused with a
GrammarError (a 400): never a crash, a RecursionError or a step that stalls the engine.

Hypothesis generates schemas together with a valid instance of each; llama.cpp runs in a child
process (a grammar that crashed it would take the test runner with it), which loads each grammar,
times one sampling step over the whole vocabulary, and feeds the instance token by token.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import string
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmd.backends.llamacpp.grammar import check_schema_bounds, schema_grammar
from llmd.backends.llamacpp.grammar_cost import grammar_cost
from llmd.errors import GrammarError

STEP_BOUND_S = 2.0  # one token's grammar work over the whole vocabulary, on a loaded CI machine

# ---- patterns, each with a string it matches ----------------------------------------------------

_CHARS = string.ascii_lowercase[:6] + "019"


def _leaf() -> st.SearchStrategy[tuple[str, str]]:
    lit = st.sampled_from(_CHARS).map(lambda c: (c, c))
    cls = st.sampled_from([("[a-c]", "b"), ("[0-9]", "7"), ("\\d", "3"), ("[^x]", "q"), (".", "z"), ("\\w", "k")])
    return lit | cls


def _quantified(inner: st.SearchStrategy[tuple[str, str]]) -> st.SearchStrategy[tuple[str, str]]:
    def q(pair: tuple[str, str], kind: str, lo: int, extra: int) -> tuple[str, str]:
        rx, s = pair
        atom = rx if len(rx) == 1 or rx.startswith(("[", "\\")) or rx == "." else f"({rx})"
        if kind == "?":
            return atom + "?", s
        if kind == "*":
            return atom + "*", s * 2
        if kind == "+":
            return atom + "+", s
        if kind == "{m}":
            return atom + f"{{{lo}}}", s * lo
        return atom + f"{{{lo},{lo + extra}}}", s * lo
    return st.builds(q, inner, st.sampled_from(["?", "*", "+", "{m}", "{m,n}", ""]), st.integers(0, 40),
                     st.integers(0, 300)).map(lambda p: p)


def patterns() -> st.SearchStrategy[tuple[str, str]]:
    def seq(parts: list[tuple[str, str]]) -> tuple[str, str]:
        return "".join(p[0] for p in parts), "".join(p[1] for p in parts)

    def alt(parts: list[tuple[str, str]]) -> tuple[str, str]:
        return "(" + "|".join(p[0] for p in parts) + ")", parts[0][1]

    tree = st.recursive(_leaf(), lambda inner: st.one_of(
        st.lists(_quantified(inner), min_size=1, max_size=4).map(seq),
        st.lists(inner, min_size=1, max_size=3).map(alt),
        inner.map(lambda p: ("(" + p[0] + ")", p[1]))), max_leaves=12)
    return tree.map(lambda p: ("^" + p[0] + "$", p[1]))


# ---- schemas, each with a valid instance --------------------------------------------------------

def _string() -> st.SearchStrategy[tuple[dict[str, Any], Any]]:
    def bounded(lo: int, extra: int | None, fmt: str | None, junk: bool) -> tuple[dict[str, Any], Any]:
        schema: dict[str, Any] = {"type": "string", "minLength": lo}
        if extra is not None:
            schema["maxLength"] = lo + extra
        if fmt:
            schema["format"] = fmt
        if junk:
            schema["additionalProperties"] = False
        return schema, "a" * lo if fmt != "email" else "a" * max(0, lo - 4) + "@b.c"[: max(lo, 4)]
    fixed = st.sampled_from([({"type": "string", "format": "date"}, "2026-12-05"),
                             ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000"),
                             ({"type": "string"}, "hello")])
    return fixed | st.builds(bounded, st.integers(4, 40), st.none() | st.integers(0, 3000),
                             st.sampled_from([None, "email", "uri", "hostname"]), st.booleans()) | \
        patterns().map(lambda p: ({"type": "string", "pattern": p[0]}, p[1]))


def _scalar() -> st.SearchStrategy[tuple[dict[str, Any], Any]]:
    return st.sampled_from([({"type": "integer"}, 42), ({"type": "number"}, -1.5), ({"type": "boolean"}, True),
                            ({"type": "null"}, None), ({"enum": ["x", 2, None]}, 2), ({"const": "k"}, "k"),
                            ({}, {"any": [1, "two"]})])


def schemas() -> st.SearchStrategy[tuple[dict[str, Any], Any]]:
    def array(item: tuple[dict[str, Any], Any], lo: int, extra: int | None, junk: bool) -> tuple[dict[str, Any], Any]:
        schema: dict[str, Any] = {"type": "array", "items": item[0], "minItems": lo}
        if extra is not None:
            schema["maxItems"] = lo + extra
        if junk:
            schema["properties"] = {}
        return schema, [item[1]] * lo

    def obj(props: dict[str, tuple[dict[str, Any], Any]], required: int) -> tuple[dict[str, Any], Any]:
        names = sorted(props)[:required]
        return ({"type": "object", "properties": {k: v[0] for k, v in props.items()}, "required": names},
                {k: v[1] for k, v in props.items() if k in names})  # in the order the grammar writes them

    def union(parts: list[tuple[dict[str, Any], Any]]) -> tuple[dict[str, Any], Any]:
        return {"anyOf": [p[0] for p in parts]}, parts[0][1]

    return st.recursive(_string() | _scalar(), lambda inner: st.one_of(
        st.builds(array, inner, st.integers(0, 3), st.none() | st.integers(0, 30), st.booleans()),
        st.builds(obj, st.dictionaries(st.text(string.ascii_lowercase, min_size=1, max_size=6), inner, max_size=5),
                  st.integers(0, 5)),
        st.lists(inner, min_size=1, max_size=3).map(union)), max_leaves=8)


# ---- llama.cpp in a child process ---------------------------------------------------------------

def _child(conn: Connection, model: str) -> None:
    import ctypes
    import time

    import llama_cpp as L

    quiet = L.llama_log_callback(lambda *a: None)  # held: llama.cpp calls it for as long as it logs
    L.llama_log_set(quiet, ctypes.c_void_p())
    params = L.llama_model_default_params()
    params.vocab_only = True
    m = L.llama_model_load_from_file(model.encode(), params)
    vocab = L.llama_model_get_vocab(m)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    everything = (L.llama_token_data * n_vocab)()
    pristine = (L.llama_token_data * n_vocab)()
    for t in range(n_vocab):
        pristine[t] = L.llama_token_data(t, 0.0, 0.0)
    one = (L.llama_token_data * 1)()
    while True:
        msg = conn.recv()
        if msg is None:
            return
        gbnf, text = msg
        s = L.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        if not s:
            conn.send(("unparsed", 0.0))
            continue
        raw = text.encode()
        toks = (L.llama_token * (len(raw) + 8))()
        n = L.llama_tokenize(vocab, raw, len(raw), toks, len(toks), False, False)
        worst, verdict = 0.0, "ok"
        for i in range(n):
            if i in (0, n // 2):  # a whole step's grammar work, as sampling does it
                ctypes.memmove(everything, pristine, ctypes.sizeof(pristine))
                arr = L.llama_token_data_array(everything, n_vocab, -1, False)
                t0 = time.perf_counter()
                L.llama_sampler_apply(s, ctypes.byref(arr))
                worst = max(worst, time.perf_counter() - t0)
            one[0] = L.llama_token_data(toks[i], 1.0, 0.0)
            arr = L.llama_token_data_array(one, 1, -1, False)
            L.llama_sampler_apply(s, ctypes.byref(arr))
            if one[0].logit == float("-inf"):
                verdict = f"rejected token {i} ({text.encode()[:60]!r})"
                break
            L.llama_sampler_accept(s, toks[i])
        L.llama_sampler_free(s)
        conn.send((verdict, worst))


class _Llama:
    """One child at a time; a crash fails the test that caused it and the next test starts another."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.proc: Any = None

    def check(self, gbnf: str, text: str) -> tuple[str, float]:
        if self.proc is None or not self.proc.is_alive():
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_child, args=(child, self.model), daemon=True)
            self.proc.start()
            child.close()  # so that a crash reads as EOF here, not as silence
        self.conn.send((gbnf, text))
        if not self.conn.poll(120):
            self.proc.kill()
            return "no answer in 120 s", 120.0
        try:
            return self.conn.recv()  # type: ignore[no-any-return]
        except EOFError:
            return f"llama.cpp crashed (exit {self.proc.exitcode})", 0.0

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(10)


@pytest.fixture(scope="module")
def llama() -> Iterator[_Llama]:
    from llmd.models.catalog import find_packaged

    runner = _Llama(str(find_packaged(Path("/tmp"))["smollm2-135m"]))
    yield runner
    runner.close()


def _accepted(schema: Any) -> str | None:
    """The grammar for `schema`, or None when llmd refuses it (a GrammarError and nothing else)."""
    try:
        check_schema_bounds(schema)
        return schema_grammar(schema)
    except GrammarError:
        return None


_SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(schemas())
def test_every_accepted_schema_loads_holds_its_instances_and_stays_in_bounds(llama: _Llama,
                                                                             case: tuple[dict[str, Any], Any]):
    schema, instance = case
    gbnf = _accepted(schema)
    if gbnf is None:
        return
    verdict, worst = llama.check(gbnf, json.dumps(instance))
    assert verdict == "ok", (verdict, schema, gbnf[:600])
    assert worst < STEP_BOUND_S, (worst, schema)


@_SETTINGS
@given(patterns())
def test_every_accepted_pattern_loads_holds_its_matches_and_stays_in_bounds(llama: _Llama, case: tuple[str, str]):
    pattern, match = case
    gbnf = _accepted({"type": "string", "pattern": pattern})
    if gbnf is None:
        return
    verdict, worst = llama.check(gbnf, json.dumps(match))
    assert verdict == "ok", (verdict, pattern, gbnf[:600])
    assert worst < STEP_BOUND_S, (worst, pattern)


@pytest.mark.parametrize("schema", [
    {"type": "string", "format": "email", "maxLength": 99999},
    {"type": "string", "maxLength": 99999, "additionalProperties": False},
    {"type": "array", "items": {"type": "string"}, "maxItems": 99999, "properties": {}},
])
def test_bounds_beside_formats_and_object_keys_are_written_flat(schema: dict[str, Any]):
    """These went to llama-cpp-python's converter, which nests one group per unit of the bound
    (99,999 deep: the worker died of it)."""
    gbnf = schema_grammar(schema)
    assert grammar_cost(gbnf).depth <= 3, gbnf[:300]
    assert "99999" in gbnf or "99998" in gbnf


@pytest.mark.parametrize("pattern", ["((a?){1000}){1000}", "(a?){1000}" * 150, "a?" * 2000,
                                     "(a?){200}(b?){200}", "((a|b?)c?){300}"], ids=lambda p: p[:24])
def test_optional_items_are_bounded_as_a_whole(pattern: str):
    """Each item alone is within bounds; nested they multiply and in a row they add up."""
    with pytest.raises(GrammarError, match="places at once|can match nothing|characters"):
        check_schema_bounds({"type": "string", "pattern": pattern})
        schema_grammar({"type": "string", "pattern": pattern})


def test_a_pattern_nested_400_groups_deep_is_a_grammar_error_not_a_recursion_error():
    with pytest.raises(GrammarError, match="nest deeper"):
        check_schema_bounds({"type": "string", "pattern": "(" * 400 + "a" + ")" * 400})
