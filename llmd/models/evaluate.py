"""What quantization cost: perplexity, and against a base model the KL divergence of the
next-token distributions, top-1 agreement and the perplexity ratio, on the same token windows.

Follows llama-perplexity's --kl-divergence: the text is cut into windows of `window` tokens;
each window is evaluated fresh with logits for every position, and only the second half of
each window is scored, so every scored token has at least half a window of context.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from llmd.errors import BadRequest


class EvalError(BadRequest):
    code = "eval_failed"


def default_text() -> str:
    return files("llmd").joinpath("data/eval_text.txt").read_text()


@dataclass(frozen=True)
class EvalResult:
    tokens_scored: int
    windows: int
    window: int
    perplexity: float
    base_perplexity: float | None = None
    ppl_ratio: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1_agreement: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Scorer:
    """One model with a context sized to a window, giving log-probabilities for every position."""

    def __init__(self, path: str, window: int, repack: bool = True) -> None:
        import llama_cpp as L

        from llmd.backends.llamacpp.context import load_model

        self.L = L
        try:
            self.model = load_model(path, 0, repack)
        except Exception as e:
            raise EvalError(str(e)) from None
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx = window
        cp.n_batch = window
        cp.n_ubatch = window
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.batch = L.llama_batch_init(window, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (self.L.llama_token * (len(data) + 8))()
        n = self.L.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, False)
        return list(buf[:n])

    def logprobs(self, tokens: list[int]) -> np.ndarray:
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        b = self.batch
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = True
        b.n_tokens = len(tokens)
        if L.llama_decode(self.ctx, b) != 0:
            raise EvalError("llama_decode failed while evaluating")
        ptr = L.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                       shape=(len(tokens), self.n_vocab)).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def evaluate(model_path: str, base_path: str | None = None, text: str | None = None, tokens: int = 1024,
             window: int = 256, repack: bool = True) -> EvalResult:
    text = default_text() if text is None else text
    scorer = _Scorer(model_path, window, repack)
    base = _Scorer(base_path, window, repack) if base_path else None
    try:
        if base is not None and base.n_vocab != scorer.n_vocab:
            raise EvalError(f"the base model's vocabulary has {base.n_vocab} tokens and this one {scorer.n_vocab}: "
                            "KL divergence needs the same vocabulary", "base")
        ids = scorer.tokenize(text)[:tokens]
        n_windows = len(ids) // window
        if n_windows < 1:
            raise EvalError(f"the text is {len(ids)} tokens; one evaluation window needs {window}. "
                            "Give a longer text (--text) or a smaller window", "text")
        nll = base_nll = 0.0
        kls: list[np.ndarray] = []
        agree = scored = 0
        first = window // 2
        for w in range(n_windows):
            chunk = ids[w * window:(w + 1) * window]
            lp = scorer.logprobs(chunk)
            targets = np.array(chunk[first + 1:])
            rows = np.arange(first, window - 1)
            nll -= lp[rows, targets].sum()
            scored += len(rows)
            if base is not None:
                blp = base.logprobs(chunk)
                base_nll -= blp[rows, targets].sum()
                p = np.exp(blp[rows])
                kls.append((p * (blp[rows] - lp[rows])).sum(axis=1))
                agree += int((blp[rows].argmax(axis=1) == lp[rows].argmax(axis=1)).sum())
        ppl = math.exp(nll / scored)
        if base is None:
            return EvalResult(scored, n_windows, window, ppl)
        kl = np.concatenate(kls)
        base_ppl = math.exp(base_nll / scored)
        return EvalResult(scored, n_windows, window, ppl, base_ppl, ppl / base_ppl, float(max(kl.mean(), 0.0)),
                          float(np.percentile(kl, 99)), agree / scored)
    finally:
        scorer.close()
        if base is not None:
            base.close()


def load_text(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise EvalError(f"cannot read the evaluation text {path}: {e.strerror}", "text") from None
