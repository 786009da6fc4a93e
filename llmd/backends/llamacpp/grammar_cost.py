"""What a GBNF grammar costs llama.cpp, computed from its text before llama.cpp sees it.

llama.cpp's grammar engine has three costs a request can blow up, whatever produced the grammar
(llmd's pattern translation, llama-cpp-python's schema converter, a tool constraint):
- its parser recurses once per nested group: 99,999 nested `(c (c ...)?)?` groups overflowed the
  worker's stack (signal 11, every stream on the model gone);
- it expands a counted repetition `x{m,n}` into about n rules;
- while sampling it keeps one parse stack per terminal reachable from the current position
  without consuming a character, deduplicated pairwise and each checked against the whole
  vocabulary at every token. Optional items multiply along nesting (`((a?){1000}){1000}`: a
  million stacks) and add up along a sequence (`a?` 200,000 times): one step then takes minutes
  and every slot of the model stalls until the hang timer kills the worker.

`grammar_cost` bounds all three for the whole grammar, not item by item: it parses the GBNF into
rules, then computes for each rule whether it can match nothing, how many stacks it opens at its
start, and the most it holds at any point inside it (each counted repetition and each rule
reference taken into account, as llama.cpp expands them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmd.errors import GrammarError

MAX_GROUP_DEPTH = 64  # nested parentheses: llama.cpp's parser recurses once per group
MAX_RULES = 250_000  # rules after llama.cpp expands counted repetitions (each link is one)
# parse stacks live at once: each is checked against the vocabulary (151k tokens for Qwen) at each
# token; measured on two cores with Qwen2.5's vocabulary, 256 stacks sample in about 30 ms a token
MAX_STACKS = 256
# llama.cpp's own parser refuses a repetition whose item (with the rules the item made) times its
# count exceeds this, a count above it, and reads a bound above it as no bound (llama-grammar.cpp,
# MAX_REPETITION_THRESHOLD): mirrored here so that what llmd accepts is what llama.cpp loads
LLAMA_REPEAT_LIMIT = 2000

_TOKEN = re.compile(r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<def>::=)
  | (?P<lit>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<name>[A-Za-z0-9_-]+)
  | (?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[()|?*+.])
""", re.X | re.S)


@dataclass
class _Item:
    atom: str | _Alt  # "" for a terminal, a rule name, or a group
    lo: int = 1
    hi: int | None = 1


@dataclass
class _Alt:
    seqs: list[list[_Item]] = field(default_factory=list)


@dataclass
class Cost:
    """A grammar's cost: its rules once expanded, its deepest group, the most parse stacks live at once."""
    rules: int
    depth: int
    stacks: int


@dataclass
class _Shape:
    nullable: bool
    first: int  # stacks opened at the start
    most: int  # stacks live at any point inside


def grammar_cost(gbnf: str, field_name: str = "response_format") -> Cost:
    """The cost of `gbnf`; a GrammarError (a 400 naming the limit) when any part of it is over."""
    tokens = _tokens(gbnf, field_name)
    rules, depth, expanded = _parse(tokens, field_name)
    if depth > MAX_GROUP_DEPTH:
        raise GrammarError(f"the grammar nests groups {depth} deep; llmd allows {MAX_GROUP_DEPTH} "
                           "(simplify the pattern or schema)", field_name)
    if expanded > MAX_RULES:
        raise GrammarError(f"the grammar expands to {expanded:,} rules; llmd allows {MAX_RULES:,} "
                           "(lower the repetition bounds, or leave out bounds no reply could reach)", field_name)
    if "root" not in rules:
        raise GrammarError("the grammar has no root rule", field_name)
    try:
        shapes = _shapes(rules, field_name)
    except ValueError as e:
        raise GrammarError(str(e), field_name) from None
    stacks = max(s.most for s in shapes.values())
    if stacks > MAX_STACKS:
        raise GrammarError(f"the grammar can be at {stacks:,} places at once (optional items repeated or nested: "
                           f"each is a parse stack checked against the whole vocabulary at every token); llmd allows "
                           f"{MAX_STACKS}: write optional parts so they cannot be skipped in long runs, "
                           "e.g. (ab){0,9} rather than (a?b?){9}", field_name)
    return Cost(expanded, depth, stacks)


def _tokens(gbnf: str, field_name: str) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(gbnf):
        m = _TOKEN.match(gbnf, i)
        if m is None:
            raise GrammarError(f"the grammar cannot be read at character {i}: {gbnf[i:i + 20]!r}", field_name)
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append((kind, m.group()))
        i = m.end()
    return out


def _parse(tokens: list[tuple[str, str]], field_name: str) -> tuple[dict[str, _Alt], int, int]:
    """Rules by name, the deepest group, and the rules llama.cpp makes of them (an iterative parser:
    the text may be nested deeper than Python's stack)."""
    rules: dict[str, _Alt] = {}
    depth = expanded = 0
    seen: set[str] = set()  # rule names, as llama.cpp numbers them when it first meets each
    symbols = 0  # llama.cpp's rule ids so far, the count its repetition limit is taken on

    def named(text: str) -> None:
        nonlocal symbols
        if text not in seen:
            seen.add(text)
            symbols += 1

    i = 0
    while i < len(tokens):
        if tokens[i][0] != "name" or i + 1 >= len(tokens) or tokens[i + 1][0] != "def":
            raise GrammarError(f"the grammar has {tokens[i][1]!r} where a rule should start", field_name)
        name, i = tokens[i][1], i + 2
        named(name)
        top = _Alt([[]])
        stack = [top]
        # per open group: the ids before it, and llama.cpp's count of rules the last item made
        starts, prev = [symbols], [1]
        expanded += 1
        while i < len(tokens) and not (tokens[i][0] == "name" and i + 1 < len(tokens) and tokens[i + 1][0] == "def"):
            kind, text = tokens[i]
            seq = stack[-1].seqs[-1]
            if kind in ("lit", "cls") or text == ".":
                seq.append(_Item(""))
                prev[-1] = 1
            elif kind == "name":
                seq.append(_Item(text))
                named(text)
                prev[-1] = 1
            elif text == "(":
                group = _Alt([[]])
                seq.append(_Item(group))
                stack.append(group)
                starts.append(symbols)
                prev.append(1)
                symbols += 1
                depth = max(depth, len(stack) - 1)
                expanded += 1
            elif text == ")":
                if len(stack) == 1:
                    raise GrammarError("the grammar closes a group it never opened", field_name)
                stack.pop()
                prev.pop()
                prev[-1] = max(1, symbols - starts.pop())
            elif text == "|":
                stack[-1].seqs.append([])
                prev[-1] = 1
            elif text in "?*+" or kind == "count":
                if not seq:
                    raise GrammarError(f"the grammar repeats nothing with {text!r}", field_name)
                item = seq[-1]
                if kind == "count":
                    nums = text.strip("{}").split(",")
                    lo = int(nums[0])
                    hi = lo if len(nums) == 1 else (int(nums[1]) if nums[1].strip() else None)
                else:
                    lo, hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}[text]
                item.lo, item.hi = lo, hi
                expanded += max(lo, hi or 0) + 1
                symbols, prev[-1] = _llama_repeat(prev[-1], lo, hi, symbols, field_name)
            else:
                raise GrammarError(f"the grammar has {text!r} where it was not expected", field_name)
            i += 1
        if len(stack) != 1:
            raise GrammarError(f"the grammar's rule {name} leaves a group open", field_name)
        rules[name] = top
    return rules, depth, expanded


def _llama_repeat(made: int, lo: int, hi: int | None, symbols: int, field_name: str) -> tuple[int, int]:
    """llama.cpp's check of one repetition of an item that made `made` rules: the rule ids after it
    and the count the next repetition of the same item is taken on."""
    if lo > LLAMA_REPEAT_LIMIT:
        raise GrammarError(f"the grammar repeats an item at least {lo:,} times; llama.cpp allows "
                           f"{LLAMA_REPEAT_LIMIT:,} (lower minLength, minItems or the pattern's count)", field_name)
    if hi is not None and hi > LLAMA_REPEAT_LIMIT:
        hi = None  # llama.cpp's own reading: a bound this high is no bound
    total = hi if hi else (lo or 1)
    if made * total > LLAMA_REPEAT_LIMIT:
        raise GrammarError(f"the grammar repeats an item of {made} rules up to {total:,} times ({made * total:,} "
                           f"rules); llama.cpp allows {LLAMA_REPEAT_LIMIT:,}: lower the count or simplify "
                           "what is repeated", field_name)
    return symbols + (1 if hi is None else hi - lo), made * total


def _shapes(rules: dict[str, _Alt], field_name: str) -> dict[str, _Shape]:
    """Every rule's shape, the rules it refers to first (an explicit stack: an object with a few
    hundred optional properties is a chain of rules as long, deeper than Python's own stack)."""
    refs = {name: _refs(alt) for name, alt in rules.items()}
    for name, used in refs.items():
        for r in used:
            if r not in rules:
                raise GrammarError(f"the grammar's rule {name} refers to a rule {r!r} it does not define", field_name)
    shapes: dict[str, _Shape] = {}
    open_: set[str] = set()
    for start in ["root", *rules]:
        if start in shapes:
            continue
        stack = [(start, iter(refs[start]))]
        open_.add(start)
        while stack:
            name, pending = stack[-1]
            child = next(pending, None)
            if child is None:
                shapes[name] = _alt_shape(rules[name], shapes)
                open_.discard(name)
                stack.pop()
            elif child not in shapes and child not in open_:
                open_.add(child)
                stack.append((child, iter(refs[child])))
    return shapes


def _refs(alt: _Alt) -> list[str]:
    out: list[str] = []
    todo = [alt]
    while todo:
        for seq in todo.pop().seqs:
            for it in seq:
                if isinstance(it.atom, _Alt):
                    todo.append(it.atom)
                elif it.atom and it.atom not in out:
                    out.append(it.atom)
    return out


def _alt_shape(alt: _Alt, shapes: dict[str, _Shape]) -> _Shape:
    seqs = [_seq_shape(s, shapes) for s in alt.seqs]
    first = sum(s.first for s in seqs)
    return _Shape(any(s.nullable for s in seqs), first, max([first] + [s.most for s in seqs]))


def _seq_shape(seq: list[_Item], shapes: dict[str, _Shape]) -> _Shape:
    items = [_item_shape(it, shapes) for it in seq]
    # from the end: the stacks opened where each item starts, reaching on past the items that can be skipped
    after, most, nullable = 0, 0, True
    for s in reversed(items):
        most = max(most, s.most + after)
        after = s.first + (after if s.nullable else 0)
        nullable = nullable and s.nullable
    return _Shape(nullable, after, max(most, after))


def _item_shape(item: _Item, shapes: dict[str, _Shape]) -> _Shape:
    if item.atom == "":
        atom = _Shape(False, 1, 1)
    elif isinstance(item.atom, str):
        # a rule met again while it is being computed is a recursion (a JSON value inside an
        # object): it opens its own stacks again where it is reached, counted there
        atom = shapes.get(item.atom) or _Shape(False, 1, 1)
    else:
        atom = _alt_shape(item.atom, shapes)
    if item.hi == 0:
        return _Shape(True, 0, 0)
    if item.hi is None and atom.nullable:
        raise ValueError("the grammar repeats without bound something that can match nothing (like (a?)*); "
                         "llama.cpp cannot hold that: write it as a*")
    copies = item.hi if item.hi is not None else max(item.lo, 1) + 1
    # each copy after the first can start where the one before it ends, and when the atom can match
    # nothing, every later copy can start there too
    reach = atom.first * (copies if atom.nullable else min(copies, 2))
    first = atom.first * (copies if atom.nullable else 1)
    return _Shape(item.lo == 0 or atom.nullable, first, max(first, atom.most + reach - atom.first))
