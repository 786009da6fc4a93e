"""Can a draft model speculate for a target? Compare their vocabularies from the GGUF headers.

The rules follow llama.cpp's `common_speculative_are_compatible`: the same tokenizer type, the
same BOS/EOS ids and add-BOS/EOS flags, vocabulary sizes within 128 of each other, and the same
text for every token id both have from 5 up (the first ids are specials some exports rename).
A draft token id the target lacks is never proposed (the engine drops it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmd.models.gguf import read_gguf

MAX_SIZE_DIFFERENCE = 128
CHECK_FROM_ID = 5


@dataclass(frozen=True)
class Vocab:
    kind: str  # tokenizer.ggml.model: gpt2, llama, ...
    tokens: tuple[str, ...]
    bos: int | None
    eos: int | None
    add_bos: bool | None
    add_eos: bool | None


def read_vocab(path: str | Path) -> Vocab:
    info = read_gguf(path, arrays=("tokenizer.ggml.tokens",))
    m = info.metadata
    return Vocab(
        kind=str(m.get("tokenizer.ggml.model", "")),
        tokens=tuple(m.get("tokenizer.ggml.tokens") or ()),
        bos=m.get("tokenizer.ggml.bos_token_id"),
        eos=m.get("tokenizer.ggml.eos_token_id"),
        add_bos=m.get("tokenizer.ggml.add_bos_token"),
        add_eos=m.get("tokenizer.ggml.add_eos_token"),
    )


def incompatibilities(target: Vocab, draft: Vocab) -> list[str]:
    """What stops `draft` from drafting for `target`, one line each; empty when it can."""
    problems = []
    if target.kind != draft.kind:
        problems.append(f"tokenizer type differs: target {target.kind or '?'}, draft {draft.kind or '?'}")
    for what, t, d in (("BOS id", target.bos, draft.bos), ("EOS id", target.eos, draft.eos),
                       ("add-BOS flag", target.add_bos, draft.add_bos),
                       ("add-EOS flag", target.add_eos, draft.add_eos)):
        if t != d and not (what.startswith("add") and {t, d} <= {None, False}):  # unset means false
            problems.append(f"{what} differs: target {t}, draft {d}")
    nt, nd = len(target.tokens), len(draft.tokens)
    if nt == 0 or nd == 0:
        problems.append(f"a vocabulary is missing from the GGUF header (target {nt} tokens, draft {nd})")
    elif abs(nt - nd) > MAX_SIZE_DIFFERENCE:
        problems.append(f"vocabulary sizes differ by {abs(nt - nd)} (target {nt}, draft {nd}; "
                        f"at most {MAX_SIZE_DIFFERENCE} allowed)")
    else:
        for i in range(CHECK_FROM_ID, min(nt, nd)):
            if target.tokens[i] != draft.tokens[i]:
                problems.append(f"token {i} differs: target {target.tokens[i]!r}, draft {draft.tokens[i]!r}")
                break
    return problems
