"""The draft model: a smaller GGUF with the target's vocabulary, proposing tokens greedily.

It lives in the target's worker with its own context and one sequence per target slot, and
remembers which tokens each sequence's KV holds. Only when asked to draft does it bring a
sequence in line with the slot's tokens, by dropping what differs (the target's rejections) and
decoding what is missing (the prompt, the target's accepted tokens) in the same batch as the
first drafted position: nothing is spent on the draft model while it is not drafting, and the
prompt's catch-up delays the second token, not the first (a long one is spread over steps).
Drafting runs all speculating slots in one batch per drafted position. Its numerics never
touch the reply: every emitted token is still the target's own sample.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from llmd.backends.llamacpp.batch import put
from llmd.backends.llamacpp.context import Decoder, load_model, new_context, resident_bytes, warm_up
from llmd.errors import EngineError

log = logging.getLogger("llmd.draft")

P_MIN = 0.3  # stop drafting a slot once the draft model's own top probability drops below this
CATCHUP_STEP = 128  # most tokens a lagging sequence catches up by in one step (about one prefill budget)


class DraftModel:
    def __init__(self, path: str, n_ctx: int, n_slots: int, threads: int, target_n_vocab: int,
                 repack: bool = True) -> None:
        import llama_cpp as L

        self._L = L
        self.path = path
        rss0 = resident_bytes()
        self.model = load_model(path, 0, repack, "the draft model")
        vocab = L.llama_model_get_vocab(self.model)
        # a draft id the target does not have is never proposed (vocabularies may differ by a few)
        self.n_vocab = L.llama_vocab_n_tokens(vocab)
        self.limit = min(self.n_vocab, target_n_vocab)
        self.n_batch = 512
        self.threads, self.repack = threads, repack
        self.ctx: Any = None  # made (and made again when the target's grows) by _make_context
        self.mem: Any = None
        self._llama_decode: Any = None
        self.seqs: list[list[int]] = []
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        try:
            self._make_context(n_ctx, n_slots)
        except EngineError:
            L.llama_batch_free(self.batch)
            L.llama_model_free(self.model)
            raise
        self.step_s = self._time_one_step()  # one drafted token for one slot, on this machine
        self.catchup_s = self.step_s / 2  # per accepted token brought in; a guess until timed
        self.rss_load = resident_bytes() - rss0  # what this copy of it costs (status: why a second copy)

    def info(self) -> dict[str, Any]:
        return {"path": self.path, "n_vocab": self.n_vocab, "step_ms": round(self.step_s * 1000, 2),
                "catchup_ms": round(self.catchup_s * 1000, 2), "rss_load_bytes": self.rss_load}

    def propose(self, jobs: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """For each (seq, context ending with the slot's pending token, k): up to k greedy drafts.
        A sequence further behind than CATCHUP_STEP tokens (a whole prompt, say) catches up by that
        much per call and drafts nothing until it is in line: one call never holds the step
        thread, and so every other stream, for a whole prefill of the draft model."""
        out: list[list[int]] = [[] for _ in jobs]
        rows: list[tuple[int, int]] = []  # (job index, batch row whose logits give its next draft)
        batch: list[tuple[int, int, int, bool]] = []
        for i, (seq, ctx, k) in enumerate(jobs):
            if k <= 0:
                continue
            self._align(seq, ctx, len(ctx) - 1)  # always recompute the last token: its logits are needed
            have = self.seqs[seq]
            missing = ctx[len(have):]
            if len(missing) > min(CATCHUP_STEP, self.n_batch - len(batch)):  # behind: one piece now, no drafts
                part = missing[: max(0, min(CATCHUP_STEP, self.n_batch - len(batch)))]
                batch.extend((t, len(have) + j, seq, False) for j, t in enumerate(part))
                have.extend(part)
                continue
            for j, t in enumerate(missing):
                batch.append((t, len(have) + j, seq, j == len(missing) - 1))
            have.extend(missing)
            rows.append((i, len(batch) - 1))
        if not rows:
            if batch:
                self._decode(batch)
            return out
        catchup = len(batch) - len(rows)  # accepted tokens brought in beside the first drafting round
        first = True
        while rows and self._timed_decode(batch, catchup if first else -1):
            first = False
            nxt: list[tuple[int, int]] = []
            batch = []
            for i, row in rows:
                seq, _, k = jobs[i]
                token, p = self._top(row)
                if token >= self.limit or p < P_MIN:
                    continue
                out[i].append(token)
                if len(out[i]) < k:
                    batch.append((token, len(self.seqs[seq]), seq, True))
                    self.seqs[seq].append(token)
                    nxt.append((i, len(batch) - 1))
            rows = nxt
        return out

    def resize(self, n_ctx: int, n_slots: int) -> None:
        """A context of `n_ctx` tokens per slot (the target's grew in place: growth.py); what the
        sequences held is dropped and caught up at the next draft."""
        self._L.llama_free(self.ctx)
        self.ctx = None
        self._make_context(n_ctx, n_slots)

    def close(self) -> None:
        L = self._L
        L.llama_batch_free(self.batch)
        if self.ctx:
            L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _make_context(self, n_ctx: int, n_slots: int) -> None:
        L = self._L
        self.ctx = new_context(self.model, n_ctx * n_slots, self.n_batch, n_slots, self.threads, unified=False)
        if not self.ctx:
            raise EngineError(f"llama.cpp could not create the draft model's context ({n_slots} x {n_ctx} tokens)")
        self.mem = L.llama_get_memory(self.ctx)
        self._llama_decode = Decoder(self.ctx, self.repack)
        self.seqs = [[] for _ in range(n_slots)]
        if not warm_up(self._llama_decode, self.batch, self.mem, 64, n_slots, self.n_vocab):
            raise EngineError(f"llama.cpp failed the draft model's warm-up decode ({self.path})")

    # ---- helpers ----------------------------------------------------------------------------

    def _align(self, seq: int, tokens: list[int], upto: int) -> None:
        """Keep the longest common prefix of the sequence's KV and tokens[:upto]; drop the rest."""
        have = self.seqs[seq]
        n = 0
        limit = min(len(have), upto)
        while n < limit and have[n] == tokens[n]:
            n += 1
        if n < len(have):
            self._L.llama_memory_seq_rm(self.mem, seq, n, -1)
            del have[n:]

    def _timed_decode(self, rows: list[tuple[int, int, int, bool]], catchup: int) -> bool:
        """Decode one drafting round and learn its cost: step_s for a round of one drafted token
        per slot, catchup_s per accepted token the first round brings in beside it (catchup >= 0
        on the first round). Timed in operation: the draft shares the cores and the caches with
        the target, so it is slower than when timed alone at load."""
        t0 = time.perf_counter()
        ok = self._decode(rows)
        dt = time.perf_counter() - t0
        if catchup > 0:
            self.catchup_s = 0.9 * self.catchup_s + 0.1 * max(0.0, dt - self.step_s) / catchup
        elif catchup < 0:
            self.step_s = 0.9 * self.step_s + 0.1 * dt
        return ok

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> bool:
        if not rows:
            return False
        for i, row in enumerate(rows):
            put(self.batch, i, *row)
        self.batch.n_tokens = len(rows)
        rc = self._llama_decode(self.batch)
        if rc != 0:  # drafting is optional: forget the KV and draft nothing this step
            log.warning("draft model llama_decode returned %s; dropping its KV", rc)
            self._L.llama_memory_clear(self.mem, True)
            for s in self.seqs:
                s.clear()
            return False
        return True

    def _top(self, row: int) -> tuple[int, float]:
        ptr = self._L.llama_get_logits_ith(self.ctx, row)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        token = int(logits.argmax())
        p = 1.0 / float(np.exp(logits - logits[token]).sum())
        return token, p

    def _time_one_step(self) -> float:
        best = float("inf")
        for pos in range(4):  # the first is a warm-up
            t0 = time.perf_counter()
            self._decode([(0, pos, 0, True)])
            best = min(best, time.perf_counter() - t0) if pos else best
        self._L.llama_memory_seq_rm(self.mem, 0, -1, -1)
        return best
