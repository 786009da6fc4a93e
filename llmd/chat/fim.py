"""Fill in the middle: the prompt an editor's completion request becomes, in the model's own tokens.

A FIM model (Qwen2.5-Coder, StarCoder, CodeLlama, DeepSeek-Coder...) learned special tokens for
"the code before the cursor", "the code after it" and "now the middle", and, for some, a
repository and a file separator to show other files first. The prompt, in the order an editor's
requests repeat best (what changes least first, so the next request reuses the most KV):

    [repo] project\n [sep] name\n text ... [sep] current\n  [pre] prefix [suf] suffix [mid]

and in llmd's own layout (`healed_fim_tokens`) the cursor's line after [mid], less its last token.

Without a file separator, other files' chunks are shown as comment-like headers. The prefix,
suffix and chunks are text and are tokenized as text (no special tokens read from them: code may
well contain "<|endoftext|>"). Backend-neutral: the engine passes its vocabulary's FIM tokens and
its tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmd.backends.base import FimPrompt

# the token texts llama.cpp itself recognizes as FIM tokens, by family, for what the daemon tells
# about a model it has not loaded (/api/show, llmd models show); the engine asks llama.cpp
_SPELLINGS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<｜fim▁begin｜>", "<|fim▁begin|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<｜fim▁hole｜>", "<|fim▁hole|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<｜fim▁end｜>", "<|fim▁end|>"),
}
REQUIRED = ("pre", "suf", "mid")
NAMES = {"pre": "FIM prefix", "suf": "FIM suffix", "mid": "FIM middle"}


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's FIM token ids (-1: the model has none)."""

    pre: int
    suf: int
    mid: int
    rep: int = -1
    sep: int = -1

    @property
    def missing(self) -> list[str]:
        return [NAMES[k] for k in REQUIRED if getattr(self, k) < 0]


def spellings_in_vocab(tokens: Sequence[str] | None) -> dict[str, str]:
    """The FIM tokens a vocabulary (its token texts) has, by role (pre, suf, mid)."""
    have = set(tokens or ())
    found = {k: next((s for s in _SPELLINGS[k] if s in have), "") for k in REQUIRED}
    return {k: v for k, v in found.items() if v}


def fim_tokens(fim: FimPrompt, toks: FimTokens, text: Callable[[str], list[int]], bos: Sequence[int] = (),
               filename: str = "") -> list[int]:
    """The prompt's tokens. `text` tokenizes text with no special tokens; `bos` starts it when the
    model wants one."""
    out = list(bos)
    if fim.extra:
        if toks.rep >= 0:
            out += [toks.rep, *text("project\n")]
        for name, body in fim.extra:
            out += [toks.sep, *text(f"{name}\n")] if toks.sep >= 0 else text(f"\n--- {name} ---\n")
            out += text(body if body.endswith("\n") else body + "\n")
        if toks.sep >= 0:
            out += [toks.sep, *text(f"{filename or 'current'}\n")]
    return out + [toks.pre, *text(fim.prefix), toks.suf, *text(fim.suffix), toks.mid]


MAX_SLID_LINES = 8  # an editor keeps N lines before the cursor: a new line slides its window this far
MAX_MIDDLE_LINES = 16  # typed lines kept after the middle token before the suffix is computed again


def typed_since(old: str, new: str) -> str | None:
    """What was typed after the prefix `old` to make the prefix `new`, or None when `new` is not
    `old` plus typing. The editor's window may have dropped some of `old`'s first lines (it sends N
    lines before the cursor, so a new line slides it); at least half of `old` must be kept."""
    start = 0
    for _ in range(MAX_SLID_LINES + 1):
        kept = old[start:]
        if new.startswith(kept) and 2 * len(kept) >= len(old):
            return new[len(kept):]
        nl = old.find("\n", start)
        if nl < 0:
            return None
        start = nl + 1
    return None


def middle_start(fim: FimPrompt, heads: Sequence[str]) -> int:
    """Where the prefix's text after the middle token begins: after one of `heads` (the text a slot
    holds before its suffix, for the same suffix) that this prefix is typing on from, so the lines
    typed since stay after the middle and the suffix's KV is kept across new lines too (at most
    MAX_MIDDLE_LINES of them); else at the cursor's line."""
    at = fim.prefix.rfind("\n") + 1
    for head in heads:
        typed = typed_since(head, fim.prefix)
        if typed is not None and typed.count("\n") <= MAX_MIDDLE_LINES:
            at = min(at, len(fim.prefix) - len(typed))
    return at


def healed_fim_tokens(fim: FimPrompt, toks: FimTokens, text: Callable[[str], list[int]], bos: Sequence[int] = (),
                      filename: str = "", cut: int | None = None) -> tuple[list[int], int]:
    """llmd's layout: the cursor's line (from `cut` on, when given: see middle_start) goes after the
    middle token, as the start of the middle, so
    typing changes only the prompt's last tokens and the suffix's KV is kept from one keystroke to
    the next (with the line at the prefix's end, each request computed the 16-line suffix again:
    128 tokens, 2.2-2.6 s on the 1.5B on two cores). The line's last token is left out and returned
    (-1 when the line is empty): the first token decoded must begin with its text (token healing),
    so the prompt never ends inside what the tokenizer would have made one token (measured without
    it: 2 characters into a word, 152 of 472 typed characters right against 422; after the spaces
    before a word, none). The caller strips that text from what it shows."""
    cut = fim.prefix.rfind("\n") + 1 if cut is None else cut
    head = FimPrompt(fim.prefix[:cut], fim.suffix, fim.extra, fim.n_indent, fim.t_max_predict_ms)
    out = fim_tokens(head, toks, text, bos, filename)
    line = text(fim.prefix[cut:]) if cut < len(fim.prefix) else []
    return out + line[:-1], (line[-1] if line else -1)


def cursor_indent(prefix: str) -> int:
    """The indentation of the cursor's line: a completion that goes below it has left the block."""
    line = prefix[prefix.rfind("\n") + 1:]
    return len(line) - len(line.lstrip(" \t"))


def ollama_template(spellings: dict[str, str], chat_template: str) -> str:
    """What Ollama's /api/show gives as the template of a model that fills in the middle, in Ollama's
    own shape: the FIM prompt when there is a suffix, else the chat template (the model's own, as
    it is). Continue and other editors turn FIM on only when the template holds {{ .Suffix }}."""
    return (f"{{{{- if .Suffix }}}}{spellings['pre']}{{{{ .Prompt }}}}{spellings['suf']}{{{{ .Suffix }}}}"
            f"{spellings['mid']}{{{{- else }}}}{chat_template}{{{{- end }}}}")


class Cut:
    """Where an editor's completion ends, as llama-server's /infill ends it: at the first line
    indented less than `n_indent` (the block the cursor is in is over; that line is not shown), or,
    after `t_max_predict_ms` of decoding, as soon as the text holds a complete line. `feed` takes
    each decoded piece and returns what may be shown now (a line's leading whitespace is held until
    its indentation is known); `flush` the rest when the model ended it."""

    def __init__(self, n_indent: int = 0, t_max_predict_ms: int | None = None) -> None:
        self.n_indent = n_indent
        self.t_max_s = t_max_predict_ms / 1000 if t_max_predict_ms else None
        self.text = ""
        self.shown = 0
        self.done = False
        self._t_first: float | None = None
        self._line = 0  # where the first line not yet judged starts

    def feed(self, piece: str, now: float) -> str:
        if self.done:
            return ""
        self._t_first = now if self._t_first is None else self._t_first
        self.text += piece
        end = len(self.text)
        if self.n_indent > 0:
            while (nl := self.text.find("\n", self._line)) >= 0:
                line = self.text[nl + 1:]
                body = line.lstrip(" \t")
                if not body or body.startswith("\n"):  # blank so far, or an empty line: undecided / fine
                    if not body:
                        end = nl  # hold the newline and the indentation until the line says more
                        break
                    self._line = nl + 1
                    continue
                if len(line) - len(body) < self.n_indent:  # shown up to the last line with text
                    end, self.done = max(self.shown, len(self.text[:nl].rstrip())), True
                    break
                self._line = nl + 1
        if (not self.done and self.t_max_s is not None and now - self._t_first >= self.t_max_s
                and "\n" in self.text[:end]):
            self.done = True
        out = self.text[self.shown:end]
        self.shown = max(self.shown, end)
        return out

    def flush(self) -> str:
        """What was held back, once the model itself ended the reply."""
        if self.done:
            return ""
        out, self.shown = self.text[self.shown:], len(self.text)
        return out
