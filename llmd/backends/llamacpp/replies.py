"""A reply token by token: sample a row's logits, emit the text, accept or reject drafts, finish or
fail a request (issue 49: out of engine.py, whose step computes the rows these read)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from llmd.backends.base import ErrorEvent, Event, FinalEvent, TokenEvent, Usage
from llmd.backends.llamacpp.healing import spend
from llmd.backends.llamacpp.sampler import token_logprobs
from llmd.backends.llamacpp.slots import Active, Slot
from llmd.errors import EngineError

if TYPE_CHECKING:
    from llmd.backends.llamacpp.engine import LlamaCppEngine
    from llmd.backends.llamacpp.step_batch import StepBatch


class Replies:
    """The engine's replies: every emitted token is the target's own sample from the step's logits."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.e = engine

    def after_step(self, b: StepBatch, events: list[Event]) -> None:
        """What a computed step's rows give: each prompt's progress (its last rows sampled, or a
        prompt sent only to warm the cache finished), each decoding slot's token and drafts."""
        e = self.e
        done_at = time.perf_counter()
        for slot in b.slots:
            if slot.active is not None:
                slot.active.t_progress = done_at
        for slot, start, end, row in b.parts:
            a = slot.active
            assert a is not None
            slot.tokens.extend(a.prompt[start:end])
            if e.exact and slot.exact == start and e.grid.is_boundary(a.prompt, end):
                slot.exact = end
            a.pos = end
            if end == len(a.prompt):
                a.t_prefill_done = time.perf_counter()
                if a.max_tokens == 0:  # warming the cache: the prompt's KV is what was asked for
                    self.finish(slot, "length", events)
                else:
                    self.sample(slot, row + end - start - 1, events)
        for slot, row, drafts in b.plan:
            self.accept(slot, row, drafts, events)

    def accept(self, slot: Slot, row: int, drafts: list[int], events: list[Event]) -> None:
        a = slot.active
        assert a is not None and a.pending is not None
        slot.tokens.append(a.pending)
        a.pending = None
        accepted = 0
        a.drafted += len(drafts)  # counted before sampling: the last sample may finish the reply
        for j in range(len(drafts) + 1):
            if not self.sample(slot, row + j, events):
                break
            if j < len(drafts) and a.pending == drafts[j]:
                slot.tokens.append(drafts[j])  # its KV is already in place
                a.pending = None
                accepted += 1
                continue
            break
        a.accepted += accepted
        if drafts:
            self.e._L.llama_memory_seq_rm(self.e.mem, slot.seq, len(slot.tokens), -1)
            self.e.spec.record(a, len(drafts), accepted)

    def sample(self, slot: Slot, row: int, events: list[Event]) -> bool:
        """Sample, emit and account one token; True when the request goes on (token pending)."""
        a = slot.active
        assert a is not None
        with self.e.profiler.span("sample"):
            if a.heal:
                self.e.healer.restrict(self.e._L, self.e.ctx, row, self.e.healer.allowed(a.heal))
            token = a.sampler.sample(self.e.ctx, row)
        if a.req.top_logprobs is not None:
            a.logprobs.append(token_logprobs(self.e.ctx, row, token, self.e.n_vocab, a.req.top_logprobs,
                                             lambda t: self.e._piece(t).decode("utf-8", "replace")))
        now = time.perf_counter()
        step = now - a.t_last if a.n_gen > 0 else 0.0  # the last token's time: the next one's, about
        if a.n_gen == 0:
            a.t_first = now
        a.n_gen += 1
        a.t_last = now
        if self.e._L.llama_vocab_is_eog(self.e.vocab, token):
            a.n_gen -= 1  # the end-of-generation token is not part of the reply
            self.finish(slot, "stop", events, eog=True)
            return False
        with self.e.profiler.span("detokenize"):
            # with tools, marker tokens (<tool_call>, [TOOL_CALLS]...) are text the reply parser reads
            piece = self.e._piece(token, special=bool(a.req.tools))
            if a.heal:
                a.heal, piece = spend(a.heal, piece)
            text, stopped = a.text.push(piece)
        if text:
            events.append(TokenEvent(a.req.id, text, 1, tuple(a.logprobs), dropped_messages=a.first_news()))
            a.logprobs.clear()
        if stopped:
            self.finish(slot, "stop", events, flush=False)
            return False
        a.pending = token
        # answer now when the next token would come after reply_within_s
        late = a.req.reply_within_s is not None and a.told and now + step - a.t_received >= a.req.reply_within_s
        if (a.n_gen >= a.max_tokens or late) and a.req.propose_tokens > 0 and not a.proposing:
            # the reply ends here; a FIM proposal decodes on in the same slot (no prompt computed again)
            events.append(TokenEvent(a.req.id, "", 0, reply_end=self.usage(a)))
            a.proposing, a.max_tokens = True, max(a.max_tokens, a.n_gen) + a.req.propose_tokens
        if a.n_gen >= a.max_tokens or len(slot.tokens) + 1 >= a.n_ctx:
            self.finish(slot, "length", events)
            return False
        return True

    def finish(self, slot: Slot, reason: str, events: list[Event], flush: bool = True, eog: bool = False) -> None:
        a = slot.active
        assert a is not None
        if flush:
            rest = a.text.flush()
            if rest or a.logprobs:
                events.append(TokenEvent(a.req.id, rest, 0, tuple(a.logprobs), dropped_messages=a.first_news()))
        events.append(FinalEvent(a.req.id, reason, self.usage(a)))
        a.sampler.close()
        slot.active = None
        slot.last_used = time.monotonic()
        # anticipatory prefill, when idle: the next turn's header after the reply as the client got it
        # (ended by the model, or cut at max_tokens: then its last token is not in the KV yet)
        ends = [] if eog else [a.pending] if reason == "length" and a.pending is not None else None
        if (ends is not None and not self.e.exact and a.req.messages is not None and not a.req.raw
                and self.e._next_turn and len(slot.tokens) + len(ends) + len(self.e._next_turn) < a.n_ctx):
            slot.tail = [*ends, *self.e._next_turn]
        self.e.requests_done += 1

    @staticmethod
    def usage(a: Active) -> Usage:
        t_end = a.t_last or time.perf_counter()
        return Usage(
            prompt_tokens=len(a.prompt),
            completion_tokens=a.n_gen,
            cached_tokens=a.cached,
            ttft_s=(a.t_first - a.t_received) if a.t_first else 0.0,
            prefill_s=(a.t_prefill_done - a.t_received) if a.t_prefill_done else 0.0,
            decode_s=(t_end - a.t_first) if a.t_first else 0.0,
            queue_s=(a.t_admitted - a.t_received) if a.t_admitted else 0.0,
            drafted_tokens=a.drafted,
            accepted_tokens=a.accepted,
            dropped_messages=a.dropped,
        )

    def fail(self, slot: Slot, events: list[Event], message: str) -> None:
        a = slot.active
        assert a is not None
        events.append(ErrorEvent(a.req.id, EngineError(message).to_wire()))
        a.sampler.close()
        slot.active = None
        slot.forget(self.e._L, self.e.mem)  # the sequence's KV may be partly written
