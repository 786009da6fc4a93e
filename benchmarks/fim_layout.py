"""Where the cursor's line goes in a FIM prompt: at the prefix's end (the plain order: llmd's and
llama-server's) or after the middle token, as the start of the middle (typing then changes only
tokens after the suffix, so the suffix's KV would be kept), judged on what matters to an editor:
what the model writes and what the next keystroke's request must compute again.

At each word end of the autocomplete benchmark's trace (Python's textwrap.py from line 120, the
same 48-line prefix and 16-line suffix windows), both prompts are decoded greedily for n_predict
24 tokens with llama-cpp-python, no server: *right* is the longest start of the completion that
the person then types (what Tab would take), each typed character counted once. `--cursor`
places the cursor at word ends (the autocomplete benchmark's pauses), two characters into words,
or after the spaces before a word. *Recomputed* is how many of the request's prompt
tokens come after the longest start it shares with the previous request's prompt (what a server
with the previous request's KV in the slot must compute again).

    python benchmarks/fim_layout.py --model ~/.cache/llmd/test-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _harness import cpu_name  # noqa: E402
from autocomplete import N_PREDICT, Event, common, trace, windows  # noqa: E402

from llmd.backends.base import FimPrompt  # noqa: E402
from llmd.backends.llamacpp.healing import Healer, spend  # noqa: E402
from llmd.chat.fim import FimTokens, fim_tokens, healed_fim_tokens  # noqa: E402


def line_after_middle(fim: FimPrompt, toks: FimTokens, text) -> list[int]:  # type: ignore[no-untyped-def]
    cut = fim.prefix.rfind("\n") + 1
    return [toks.pre, *text(fim.prefix[:cut]), toks.suf, *text(fim.suffix), toks.mid, *text(fim.prefix[cut:])]


def healed(fim: FimPrompt, toks: FimTokens, text) -> list[int]:  # type: ignore[no-untyped-def]
    """llmd's layout (llmd.chat.fim.healed_fim_tokens): the line after the middle, its last token
    backed off, which the first tokens decoded must spell (token healing; main() restricts them
    with the engine's Healer and strips the healed text)."""
    return healed_fim_tokens(fim, toks, text)[0]


# where the cursor stops: after a word (the autocomplete benchmark's pauses), two characters into
# a word of four or more, or after the spaces or the indentation before a word
CURSORS = {"word-end": r"\w(?=[^\w])", "mid-word": r"(?<![\w])\w\w(?=\w\w)", "after-space": r"[ \t]+(?=\w)"}


def cursor_trace(text: str, start_line: int, words: int, where: str) -> tuple[list[Event], int]:
    if where == "word-end":
        return trace(text, start_line, words)
    events, _ = trace(text, start_line, words)  # the same stretch of the file
    start, end = events[0].at - 1, events[-1].at
    return [Event(start + m.end(), 0.0) for m in re.finditer(CURSORS[where], text[start:end])], end


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--words", type=int, default=80)
    ap.add_argument("--start-line", type=int, default=120)
    ap.add_argument("--cursor", choices=list(CURSORS), default="word-end")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads (1 beside other work)")
    ap.add_argument("--layouts", default="plain,after-middle,healed", help="which layouts, comma-separated")
    args = ap.parse_args()
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(args.model, n_ctx=4096, n_threads=args.threads, verbose=False)

    def tok(t: str) -> list[int]:
        return llm.tokenize(t.encode(), add_bos=False, special=False)

    def special(t: str) -> int:
        ids = llm.tokenize(t.encode(), add_bos=False, special=True)
        assert len(ids) == 1, f"{t} is not one token in this model"
        return ids[0]

    toks = FimTokens(pre=special("<|fim_prefix|>"), suf=special("<|fim_suffix|>"), mid=special("<|fim_middle|>"))
    stops = {llm.token_eos(), toks.pre, toks.suf, toks.mid, special("<|endoftext|>"), special("<|file_sep|>")}
    source = Path(textwrap.__file__).read_text()
    events, end = cursor_trace(source, args.start_line, args.words, args.cursor)
    every = {"plain": ("line at the prefix's end (llama-server)", fim_tokens),
             "after-middle": ("line after the middle", line_after_middle),
             "healed": ("line after the middle, last token healed (llmd)", healed)}
    layouts = dict(every[k] for k in args.layouts.split(","))
    n_vocab = llm.n_vocab()
    pieces = [llm.detokenize([i], special=False) for i in range(n_vocab)]
    healer = Healer(lambda t: pieces[t], n_vocab)
    typed = events[-1].at - events[0].at + 1
    print(f"# FIM layout: {Path(textwrap.__file__).name} from line {args.start_line}, {len(events)} cursors ({args.cursor}), "
          f"greedy, n_predict {N_PREDICT}; {Path(args.model).stem}; {cpu_name()}\n")
    print("| layout | characters right | completions with any right | prompt tokens recomputed, median (p90) |")
    print("|---|---|---|---|")
    for name, build in layouts.items():
        covered: set[int] = set()  # each typed character counted once, as the autocomplete benchmark does
        hits, recomputed, prev = 0, [], []
        for ev in events:
            before, line, after = windows(source, ev.at, end)
            prompt = build(FimPrompt(prefix=before + line, suffix=after), toks, tok)
            recomputed.append(len(prompt) - shared(prev, prompt))
            prev = prompt
            heal = b""
            if build is healed:
                last = healed_fim_tokens(FimPrompt(prefix=before + line, suffix=after), toks, tok)[1]
                heal = pieces[last] if last >= 0 else b""
            n_prompt = len(prompt)

            def healing(ids, logits, heal=heal, n=n_prompt):  # type: ignore[no-untyped-def]
                for t in ids[n:]:  # what the tokens decoded so far have spelled of it
                    heal, _ = spend(heal, pieces[t])
                if not heal:
                    return logits
                allowed = healer.allowed(heal)
                masked = np.full_like(logits, -np.inf)
                masked[allowed] = logits[allowed]
                return masked

            out: list[int] = []
            for t in llm.generate(prompt, temp=0.0, top_k=1, reset=True, logits_processor=[healing]):
                if t in stops or len(out) >= N_PREDICT:
                    break
                out.append(t)
            rest, shown = heal, []
            for t in out:
                rest, piece = spend(rest, pieces[t])
                shown.append(piece)
            got = b"".join(shown).decode(errors="replace")
            n = common(got, source[ev.at:end])
            covered.update(range(ev.at, ev.at + n))
            hits += n > 0
        rc = sorted(recomputed[1:])
        print(f"| {name} | {len(covered)} of {typed} | {hits}/{len(events)} | {statistics.median(rc):.0f} "
              f"({rc[int(0.9 * (len(rc) - 1))]}) |", flush=True)


if __name__ == "__main__":
    main()
