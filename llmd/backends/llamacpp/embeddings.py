"""Embeddings from the loaded model: a second llama.cpp context with embeddings on.

Created at the first embedding request, beside the generation context (same weights, its own
small KV), with the context the model starts with; an input longer than that makes it again with
more, up to the model's ceiling (its trained context, or what memory allows), as a chat's context
grows by use (issue 48: Qwen3-Embedding is trained for 32k tokens, and its inputs were refused at
8k). The pooling is the one the GGUF declares; a causal model that declares none gets mean pooling
over its last hidden states. Vectors are normalized to unit length, as OpenAI's and Ollama's are,
and travel as float32 bytes.
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable
from typing import Any

from llmd.backends.base import EmbedRequest, EmbedResult
from llmd.backends.llamacpp.batch import put
from llmd.backends.llamacpp.context import Decoder, new_context, tokenize
from llmd.errors import BadRequest, ContextGrow, ContextOverflow, EngineError


def kv_bytes_per_token(model: Any) -> int:
    """The KV cache one token takes in an embedding context (f16 K and V in every layer)."""
    import llama_cpp as L

    head = int(L.llama_model_n_embd(model)) // max(1, int(L.llama_model_n_head(model)))
    return int(L.llama_model_n_layer(model)) * int(L.llama_model_n_head_kv(model)) * head * 2 * 2


def grown_size(n_ctx: int, needed: int, ceiling: int) -> int:
    """The context an input of `needed` tokens makes: doubled until it holds it, at most `ceiling`."""
    while n_ctx < needed:
        n_ctx *= 2
    return min(n_ctx, ceiling)


class Embedder:
    def __init__(self, model: Any, vocab: Any, n_ctx: int, threads: int, repack: bool = True,
                 ceiling: int = 0) -> None:
        import llama_cpp as L

        self._L = L
        self.vocab = vocab
        self.n_ctx = n_ctx
        self.ceiling = max(n_ctx, ceiling)  # what it may be made again with for a longer input
        self.dim = int(L.llama_model_n_embd(model))
        self.add_bos = bool(L.llama_vocab_get_add_bos(vocab))
        self.n_vocab = int(L.llama_vocab_n_tokens(vocab))
        # a pooled input must fit one micro-batch; pooling UNSPECIFIED: the model's own, if it has one
        ctx = new_context(model, n_ctx, n_ctx, 1, threads, pooling=L.LLAMA_POOLING_TYPE_UNSPECIFIED)
        if ctx and L.llama_pooling_type(ctx) == L.LLAMA_POOLING_TYPE_NONE:
            L.llama_free(ctx)
            ctx = new_context(model, n_ctx, n_ctx, 1, threads, pooling=L.LLAMA_POOLING_TYPE_MEAN)
        if not ctx:
            raise EngineError(f"llama.cpp could not create an embedding context of {n_ctx} tokens; "
                              "try a smaller LLMD_CTX")
        self.ctx = ctx
        self.pooling = {L.LLAMA_POOLING_TYPE_MEAN: "mean", L.LLAMA_POOLING_TYPE_CLS: "cls",
                        L.LLAMA_POOLING_TYPE_LAST: "last"}.get(L.llama_pooling_type(ctx), "other")
        self.mem = L.llama_get_memory(ctx)
        self._decode = Decoder(ctx, repack)  # the one decode path (and its test crash switch)
        self.batch = L.llama_batch_init(n_ctx, 0, 1)

    def tokens(self, item: str | tuple[int, ...], index: int) -> list[int]:
        toks = list(item) if isinstance(item, tuple) else tokenize(self.vocab, item, self.add_bos, False)
        bad = next((t for t in toks if not 0 <= t < self.n_vocab), None)
        if bad is not None:  # e.g. tiktoken ids for another model's vocabulary
            raise BadRequest(f"input[{index}] holds token id {bad}, outside this model's vocabulary of {self.n_vocab}; "
                             "send text, or token ids from this model's tokenizer", "input")
        if not toks:
            raise ContextOverflow(f"input[{index}] is empty; embed at least one token of text", "input")
        return toks

    def fitted(self, toks: list[int], index: int, truncate: bool) -> list[int]:
        """The input as this context reads it: whole, cut to the context when truncation is asked
        for, else refused."""
        if len(toks) > self.n_ctx:
            if not truncate:
                raise ContextOverflow(f"input[{index}] is {len(toks)} tokens but the context holds {self.n_ctx}: "
                                      "shorten it, or ask for truncation (truncate: true)", "input")
            toks = toks[: self.n_ctx]
        return toks

    def embed(self, req: EmbedRequest, between: Callable[[], None] | None = None,
              turn: Callable[[], None] | None = None) -> EmbedResult:
        """Each input in its own decode. `between` (the worker's heartbeat) runs before each and,
        through llama.cpp's abort callback, between the graph's operations: one input of a whole
        context is a single decode that can take a minute, and 16 of them outlast LLMD_HANG_S. A
        kernel that is stuck reaches no callback, so a real hang is still seen. `turn` runs before each
        input too: it returns when the CPU board lets this background work go on (worker.BoardTurn)."""
        L = self._L
        token_lists = [self.tokens(item, i) for i, item in enumerate(req.inputs)]
        longest = max(len(t) for t in token_lists)
        if self.n_ctx < longest and self.n_ctx < self.ceiling and (req.truncate or longest <= self.ceiling):
            raise ContextGrow(f"an input is {longest} tokens and the embedding context holds {self.n_ctx}",
                              "input", min(longest, self.ceiling))
        token_lists = [self.fitted(t, i, req.truncate) for i, t in enumerate(token_lists)]
        if between is not None:
            beat = L.ggml_abort_callback(lambda _data: bool(between()))  # None: never abort
            L.llama_set_abort_callback(self.ctx, beat, None)
        try:
            return self._embed(req, token_lists, between, turn)
        finally:
            if between is not None:
                L.llama_set_abort_callback(self.ctx, L.ggml_abort_callback(), None)

    def _embed(self, req: EmbedRequest, token_lists: list[list[int]], between: Callable[[], None] | None,
               turn: Callable[[], None] | None = None) -> EmbedResult:
        L = self._L
        vectors, counts = [], []
        for toks in token_lists:
            if turn is not None:  # another model's more urgent request goes first, input by input
                turn()
            if between is not None:
                between()
            L.llama_memory_clear(self.mem, True)
            for i, t in enumerate(toks):
                put(self.batch, i, t, i, 0, True)
            self.batch.n_tokens = len(toks)
            if self._decode(self.batch) != 0:
                raise EngineError(f"llama.cpp could not embed an input of {len(toks)} tokens")
            ptr = L.llama_get_embeddings_seq(self.ctx, 0)
            if not ptr:
                raise EngineError("llama.cpp returned no pooled embedding for this model")
            values = [float(ptr[j]) for j in range(self.dim)]
            norm = math.sqrt(sum(v * v for v in values)) or 1.0
            vectors.append(array.array("f", (v / norm for v in values)).tobytes())
            counts.append(len(toks))
        L.llama_memory_clear(self.mem, True)
        return EmbedResult(req.id, tuple(vectors), tuple(counts), self.dim)

    def close(self) -> None:
        if self.ctx:
            self._L.llama_batch_free(self.batch)
            self._L.llama_free(self.ctx)
            self.ctx = None
