"""Which drafter drafts for which slot, and how many tokens: the cost-aware part of speculation.

For each decoding slot that may speculate, every step: pick the drafter and draft length k with
the most expected tokens per second for the whole batch. Verifying costs t(rows) for the step's
batch (measured on this machine), drafting with the draft model costs k of its own steps, and a
drafter whose recent acceptance is p yields 1 + p + ... + p^k tokens on average. k = 0 (plain
decoding) wins whenever drafting does not pay; then one draft is still probed now and then, so
the acceptance estimate can recover.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmd.backends.llamacpp.batch import put
from llmd.backends.llamacpp.draft_model import DraftModel
from llmd.backends.llamacpp.drafters import NgramDrafter
from llmd.backends.llamacpp.slots import Active
from llmd.errors import BadRequest

log = logging.getLogger("llmd.speculation")

LENGTHS = (1, 2, 3, 4, 6, 8)
PROBE_EVERY = 8  # steps without drafting before one probe draft
FIRST_GUESS = 0.8  # acceptance assumed for a drafter a request has not tried yet
# The draft model must promise this much more than plain decoding: measured here, its estimate
# is optimistic by a few percent (the draft model and the target evict each other's weights
# from the caches), and a marginal draft that loses is worse than none. n-gram drafts cost no
# model, so their estimate holds and they need no margin.
DRAFT_MARGIN = 1.1
# Until t(k) is measured (when the engine is first idle after a speculating request), every row
# is assumed to cost this much: drafting never pays then, so only probes and 'draft' draft.
UNMEASURED_ROW_S = 1.0
# A draft model's catch-up on a long gap (the prompt) is paid once, so it is weighed against the
# tokens it could speed up: the reply's room, but no more than a typical reply's length. Weighed
# against the room alone (the context's end, when max_tokens is unset) an 8.6k-token Codex prompt
# looked cheap to catch up: the 0.5B draft then spent 128 tokens of prefill in each of 67 steps
# (750 ms a step) for a 95-token reply that never drafted.
TYPICAL_REPLY = 256
# t(k) is measured at these draft lengths (linear between), each after a context this long: long
# enough to attend over, short enough that redoing it after an interruption costs little (16
# tokens ~0.3 s on the 1.5B on two cores; 64 took ~1.5 s)
COST_POINTS = (0, 1, 2, 4, 8)
COST_CONTEXT = 16


@dataclass
class Job:
    """One slot's part of the step: its tokens so far (ending with the pending one) and room left."""

    active: Active
    seq: int
    context: list[int]
    room: int


class Speculator:
    def __init__(self, draft: DraftModel | None = None, draft_error: str = "") -> None:
        self.ngram = NgramDrafter()
        self.draft = draft
        self.draft_error = draft_error
        # drafts verified -> seconds for that batch: measured when idle, then kept up to date by real steps
        self.cost: dict[int, float] = {}
        self.want_cost = False
        # points of a measurement a command cut short: the next idle moment measures only the rest
        self.measured: dict[int, float] = {}
        self.totals = {"ngram": [0, 0], "draft": [0, 0]}  # drafter -> [drafted, accepted]
        # recent acceptance across requests: where a new request's estimate starts
        self.prior = {"ngram": FIRST_GUESS, "draft": FIRST_GUESS}
        # live traffic, a lone stream's decode steps by drafter ("" = plain): [tokens, seconds]
        self.lone: dict[str, list[float]] = {"": [0, 0.0], "ngram": [0, 0.0], "draft": [0, 0.0]}

    def drafters_for(self, mode: str) -> tuple[str, ...]:
        """The drafters a request's `speculation` mode allows; 'draft' needs a paired draft model."""
        if mode == "off":
            return ()
        if mode == "ngram":
            return ("ngram",)
        if mode == "draft":
            if self.draft is None:
                why = (f"its draft model failed to load: {self.draft_error}" if self.draft_error else
                       "no draft model is paired with it; pair one with `llmd models pair TARGET DRAFT`")
                raise BadRequest(f"speculation 'draft' is not available for this model: {why}", "speculation")
            return ("draft",)
        if mode in ("auto", ""):
            return ("ngram", "draft") if self.draft is not None else ("ngram",)
        raise BadRequest(f"speculation must be auto, off, ngram or draft, not {mode!r}", "speculation")

    def plan(self, jobs: list[Job], rows: int) -> list[list[int]]:
        """Drafts for each job; `rows` counts the step's batch rows before any drafts."""
        out: list[list[int]] = [[] for _ in jobs]
        for_model: list[tuple[int, int]] = []  # (job index, k)
        for i, job in enumerate(jobs):
            a = job.active
            gap = len(job.context) - len(self.draft.seqs[job.seq]) if self.draft is not None else 0
            kind, k = self._choose(a, rows - 1, job.room, gap)
            if kind == "ngram":
                out[i] = self.ngram.propose(job.context, k)
                if not out[i] and "draft" in a.drafters:
                    kind, k = self._choose(a, rows - 1, job.room, gap, only="draft")
            if kind == "draft" and k > 0:
                for_model.append((i, k))
            a.last_drafter = kind
            rows += len(out[i]) or (k if kind == "draft" else 0)
        if for_model:
            assert self.draft is not None
            got = self.draft.propose([(jobs[i].seq, jobs[i].context, k) for i, k in for_model])
            for (i, _), drafts in zip(for_model, got, strict=True):
                out[i] = drafts
        return out

    def record(self, a: Active, drafted: int, accepted: int) -> None:
        kind = a.last_drafter
        if not drafted or not kind:
            return
        ema = a.accept_ema.get(kind, self.prior[kind])
        a.accept_ema[kind] = 0.7 * ema + 0.3 * accepted / drafted
        self.prior[kind] = 0.9 * self.prior[kind] + 0.1 * accepted / drafted
        self.totals[kind][0] += drafted
        self.totals[kind][1] += accepted

    def note_lone_step(self, kind: str, tokens: int, seconds: float) -> None:
        """A step that decoded one stream alone, drafts and sampling included."""
        self.lone[kind][0] += tokens
        self.lone[kind][1] += seconds

    def speedup(self) -> dict[str, float]:
        """Measured on live traffic: each drafter's tokens/s over plain decoding's for a lone
        stream (plain from its own steps, or from t(0) while auto has hardly decoded plainly)."""
        tokens, seconds = self.lone[""]
        plain = tokens / seconds if tokens >= 32 else 1 / self.cost[0] if 0 in self.cost else 0.0
        return {k: round(t / s / plain, 2) for k, (t, s) in self.lone.items() if k and t >= 32 and plain}

    def stats(self) -> dict[str, Any]:
        by = {k: {"drafted": d, "accepted": acc, "acceptance": round(acc / d, 3) if d else None}
              for k, (d, acc) in self.totals.items()}
        out: dict[str, Any] = {"verify_cost_ms": {k: round(v * 1000, 2) for k, v in self.cost.items()}, **by,
                               "speedup": self.speedup()}
        if self.draft is not None:
            out["draft_model"] = self.draft.info()
        elif self.draft_error:
            out["draft_model"] = {"error": self.draft_error}
        return out

    # ---- the choice -----------------------------------------------------------------------------

    def _choose(self, a: Active, others: int, room: int, gap: int = 1, only: str = "") -> tuple[str, int]:
        """(drafter, k) with the best expected tokens per second for the batch; ("", 0) is plain.
        `gap`: tokens the draft model must catch up on before it drafts for this slot."""
        if a.auto and others > 0:
            # Beside other sequences, drafts do not ride along: with one KV stream per slot llama.cpp
            # splits a batch into ubatches holding the same number of tokens of each sequence, so a
            # slot's extra rows cost a whole extra pass over the weights. Measured with 4 clients:
            # auto's probes alone cost 15% of aggregate tokens/s. `auto` drafts only for a lone stream.
            return "", 0
        best, plain = ("", 0), (others + 1) / self.t(others)
        best_value = plain
        if a.drafters == ("draft",) and room >= 1:
            # 'draft' asked for the draft model: it always drafts, the model only picks k (probing
            # it after a pause would cost a catch-up of every token decoded meanwhile)
            best, best_value = ("draft", 1), 0.0
        for kind in (only,) if only else a.drafters:
            p = a.accept_ema.get(kind, self.prior[kind])
            per_draft, fixed = 0.0, 0.0
            if kind == "draft" and self.draft is not None:
                # catching up: about one token a step once drafting; a larger gap (the prompt, or
                # tokens decoded without it) is paid once, so it is spread over the tokens it serves
                per_draft = self.draft.step_s
                fixed = self.draft.catchup_s * (1 + max(0, gap - 2) / max(1, min(room, TYPICAL_REPLY)))
            for k in LENGTHS:
                if k > room:
                    break
                # tokens per second for the whole batch: the other slots' rows are slowed down too
                value = (others + sum(p**i for i in range(k + 1))) / (self.t(others + k) + fixed + k * per_draft)
                margin_met = kind != "draft" or a.drafters == ("draft",) or value > DRAFT_MARGIN * plain
                if value > best_value and margin_met:
                    best, best_value = (kind, k), value
        if best[1] > 0 or not a.drafters or room < 1:
            a.steps_without_draft = 0
            return best
        a.steps_without_draft += 1  # not paying now: probe one draft now and then
        if a.steps_without_draft < PROBE_EVERY:
            return best
        # auto does not probe the draft model: catching it up costs about a prefill of the gap
        probe = [d for d in ((only,) if only else a.drafters) if d == "ngram"]
        if not probe:
            return best
        a.steps_without_draft = 0
        return max(probe, key=lambda d: a.accept_ema.get(d, self.prior[d])), 1

    def measure_cost(self, decode: Callable[[Any], int], batch: Any, mem: Any, seq: int, token: int,
                     interrupted: Callable[[], bool] = lambda: False) -> bool:
        """t(k): the best of 3 timings of verifying k drafts after a short context, in sequence
        `seq` (which the caller gives up for it). Given up (False) when a decode fails or is
        aborted, or `interrupted` says a command is waiting; the points measured by then are kept,
        so the next idle moment measures only the rest (restarting cost a client that sends a
        request every few seconds both cores between its requests, for as long as it kept on)."""
        import llama_cpp as L

        todo = [k for k in COST_POINTS if k not in self.measured]
        if todo:
            for j in range(COST_CONTEXT):
                put(batch, j, token, j, seq, False)
            batch.n_tokens = COST_CONTEXT
            if decode(batch) != 0:
                return False
        for k in todo:
            best = float("inf")
            for _ in range(3):
                if interrupted():
                    return False
                for j in range(k + 1):
                    put(batch, j, token, COST_CONTEXT + j, seq, True)
                batch.n_tokens = k + 1
                t0 = time.perf_counter()
                rc = decode(batch)
                best = min(best, time.perf_counter() - t0)
                L.llama_memory_seq_rm(mem, seq, COST_CONTEXT, -1)
                if rc != 0:
                    return False
            self.measured[k] = best
        self.cost = dict(self.measured)
        log.info("verification cost by draft length (ms): %s", {k: round(v * 1000, 1) for k, v in self.cost.items()})
        return True

    def observe(self, rows: int, seconds: float) -> None:
        """Fold a real step's decode time into t(rows - 1): in operation the batch shares the caches
        with the draft model and the rest of the daemon, which the idle measurement does not see."""
        if self.cost and rows >= 1:
            k = rows - 1
            self.cost[k] = 0.9 * self.t(k) + 0.1 * seconds

    def t(self, drafts: int) -> float:
        """Seconds for a batch of drafts + 1 rows: measured points, linear between and beyond them."""
        if not self.cost:
            self.want_cost = True
            return (drafts + 1) * UNMEASURED_ROW_S
        if drafts in self.cost:
            return self.cost[drafts]
        ks = sorted(self.cost)
        lo = max([k for k in ks if k < drafts], default=ks[0])
        hi = min([k for k in ks if k > drafts], default=ks[-1])
        if hi == lo:  # beyond the measured range: extend the last slope
            lo, hi = ks[-2], ks[-1]
        slope = (self.cost[hi] - self.cost[lo]) / (hi - lo)
        return self.cost[lo] + slope * (drafts - lo)
