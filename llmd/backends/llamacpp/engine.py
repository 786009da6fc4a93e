"""The llama.cpp engine: one model, one context with several slots, one step loop.

Each step: admit waiting requests into free slots (longest shared prefix first), advance one
prefilling slot by one aligned chunk in its own llama_decode, then decode one token for every
decoding slot in one shared batch and sample each with its own native sampler chain. When
nothing is waiting or running, idle slots re-prefill the whole chunks of their last reply so
the next turn reuses exact KV (DESIGN: Determinism).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmd.backends.base import (
    EngineConfig,
    ErrorEvent,
    Event,
    FinalEvent,
    GenerationRequest,
    TokenEvent,
    Usage,
)
from llmd.backends.llamacpp.batch import put
from llmd.backends.llamacpp.chat_template import ChatTemplate
from llmd.backends.llamacpp.draft_model import DraftModel
from llmd.backends.llamacpp.prefix_cache import PrefixStore, PrefixWriter, block_hashes, namespace
from llmd.backends.llamacpp.sampler import SamplerChain, grammar_for
from llmd.backends.llamacpp.slots import Active, Slot
from llmd.backends.llamacpp.speculation import Job, Speculator
from llmd.backends.llamacpp.text import TextStream
from llmd.backends.profile import Profiler
from llmd.errors import BadRequest, ContextOverflow, EngineError, LlmdError

log = logging.getLogger("llmd.engine")


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except Exception:
        return os.cpu_count() or 1


class LlamaCppEngine:
    name = "llama.cpp"
    supports_speculation = True
    supports_prefix_cache = True
    precisions = ("gguf",)

    @staticmethod
    def preload() -> None:
        """Import llama_cpp and initialise its backend ahead of a load (for standby workers)."""
        import llama_cpp as L

        L.llama_backend_init()

    def __init__(self, cfg: EngineConfig) -> None:
        import llama_cpp as L

        self._L = L
        self.cfg = cfg
        self.chunk = cfg.chunk
        L.llama_backend_init()
        rss0 = _rss()
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp prints every load to stderr otherwise; keep errors
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = cfg.gpu_layers
        t0 = time.perf_counter()
        self.model = L.llama_model_load_from_file(cfg.model_path.encode(), mp)
        if not self.model:
            raise EngineError(f"llama.cpp could not load {cfg.model_path}; is it a complete GGUF file?")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        threads = cfg.threads or _physical_cores()
        self.n_batch = max(512, cfg.chunk, cfg.n_slots)
        cp = L.llama_context_default_params()
        cp.n_ctx = cfg.n_ctx * cfg.n_slots
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_batch
        cp.n_seq_max = cfg.n_slots
        # One KV stream per slot, not DESIGN's unified buffer: measured here, with kv_unified=True
        # the same greedy request gave different text depending on which slot (which cells of the
        # shared buffer) it landed in; with a stream per slot every slot gives identical text.
        cp.kv_unified = False
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise EngineError(
                f"llama.cpp could not create a context of {cp.n_ctx} tokens ({cfg.n_slots} slots x {cfg.n_ctx}); "
                "try a smaller LLMD_CTX or fewer LLMD_SLOTS"
            )
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.threads = threads

        self.bos = L.llama_vocab_bos(self.vocab)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos_text = self._piece(self.bos, special=True).decode("utf-8", "replace") if self.bos >= 0 else ""
        eos = L.llama_vocab_eos(self.vocab)
        eos_text = self._piece(eos, special=True).decode("utf-8", "replace") if eos >= 0 else ""
        raw_template = L.llama_model_chat_template(self.model, None)
        self.template = ChatTemplate(raw_template.decode("utf-8") if raw_template else None, self.bos_text, eos_text)

        self.slots = [Slot(seq=i) for i in range(cfg.n_slots)]
        self.waiting: deque[tuple[GenerationRequest, float]] = deque()
        self._step_times: deque[float] = deque(maxlen=256)
        self.requests_done = 0
        self.profiler = Profiler(cfg.profile, nvtx_ranges=cfg.gpu_layers > 0)
        self.interrupt: Callable[[], bool] | None = None  # set by the worker: is a command waiting?
        self._abort_cb = L.ggml_abort_callback(lambda _data: bool(self.interrupt and self.interrupt()))
        self.prefix: PrefixStore | None = None
        self.writer: PrefixWriter | None = None
        self.prefix_stats = {"hits": 0, "misses": 0, "tokens_restored": 0, "saved": 0, "dropped": 0}
        if cfg.prefix_dir and cfg.prefix_max_bytes > 0 and cfg.model_digest:
            self.ns = namespace(cfg.model_digest, cfg.chunk)
            self.prefix = PrefixStore(Path(cfg.prefix_dir), cfg.prefix_max_bytes)
            self.writer = PrefixWriter(Path(cfg.prefix_dir), cfg.prefix_max_bytes)
        self._warm_up()
        self.spec = Speculator(*self._load_draft())
        self.load_s = time.perf_counter() - t0
        self.rss_load = _rss() - rss0

    # ---- public interface -------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        L = self._L
        desc = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.model, desc, 256)
        return {
            "engine": self.name,
            "model": self.cfg.model_name,
            "path": self.cfg.model_path,
            "desc": desc.value.decode("utf-8", "replace"),
            "n_params": int(L.llama_model_n_params(self.model)),
            "size_bytes": int(L.llama_model_size(self.model)),
            "n_ctx_train": int(L.llama_model_n_ctx_train(self.model)),
            "n_ctx": self.cfg.n_ctx,
            "n_slots": self.cfg.n_slots,
            "chunk": self.chunk,
            "threads": self.threads,
            "gpu_layers": min(self.cfg.gpu_layers, int(L.llama_model_n_layer(self.model)))
            if self._L.llama_supports_gpu_offload() else 0,
            "n_layer": int(L.llama_model_n_layer(self.model)),
            "load_s": round(self.load_s, 3),
            "rss_load_bytes": self.rss_load,
            "chat_template": "builtin-chatml" if self.template.builtin else "gguf",
            "pid": os.getpid(),
        }

    def submit(self, req: GenerationRequest) -> None:
        self.waiting.append((req, time.perf_counter()))

    def cancel(self, request_id: str) -> None:
        for i, (req, _) in enumerate(self.waiting):
            if req.id == request_id:
                del self.waiting[i]
                return
        for slot in self.slots:
            if slot.active is not None and slot.active.req.id == request_id:
                slot.active.cancelled = True

    def has_work(self) -> bool:
        return (bool(self.waiting) or any(s.active for s in self.slots) or self._idle_slot() is not None
                or self._cost_pending())

    def _cost_pending(self) -> bool:
        return (self.spec.want_cost and not self.spec.cost and not self.waiting
                and all(s.active is None for s in self.slots))

    def _load_draft(self) -> tuple[DraftModel | None, str]:
        """The paired draft model, if any. A draft that fails to load leaves the target serving
        without it; requests asking for 'draft' are then told why."""
        if not self.cfg.draft_path:
            return None, ""
        try:
            return DraftModel(self.cfg.draft_path, self.cfg.n_ctx, self.cfg.n_slots, self.threads, self.n_vocab), ""
        except Exception as e:
            log.warning("draft model %s not loaded: %s", self.cfg.draft_path, e)
            return None, str(e)

    def stats(self) -> dict[str, Any]:
        times = sorted(self._step_times)
        return {
            "slots_busy": sum(1 for s in self.slots if s.active),
            "slots": len(self.slots),
            "waiting": len(self.waiting),
            "step_ms_p50": round(times[len(times) // 2] * 1000, 2) if times else None,
            "requests_done": self.requests_done,
            "idle_work": self._idle_slot() is not None or self._cost_pending(),  # still to do when idle
            "speculation": self.spec.stats(),
            "prefix_cache": dict(self.prefix_stats, enabled=self.prefix is not None),
            "profile": self.profiler.summary(),
        }

    def close(self) -> None:
        L = self._L
        if self.writer is not None:
            self.writer.close()
        for slot in self.slots:
            if slot.active:
                slot.active.sampler.close()
        if self.spec.draft is not None:
            self.spec.draft.close()
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    # ---- the step loop ----------------------------------------------------------------------

    def step(self) -> list[Event]:
        t0 = time.perf_counter()
        events: list[Event] = []
        self._release_cancelled(events)
        self._admit(events)
        prefilling = [s for s in self.slots if s.active and s.active.prefilling]
        decoding = [s for s in self.slots if s.active and not s.active.prefilling]
        if prefilling:
            # oldest first; one aligned chunk per step so running streams keep flowing
            self._prefill_chunk(min(prefilling, key=lambda s: s.active.t_received), events)  # type: ignore[union-attr]
        if decoding:
            self._decode(decoding, events)
        if not prefilling and not decoding:
            slot = self._idle_slot()
            if slot is not None and not self.waiting:
                self._reprefill_chunk(slot)
            elif self._cost_pending():
                self._measure_cost()
        else:
            self._step_times.append(time.perf_counter() - t0)
        return events

    def _release_cancelled(self, events: list[Event]) -> None:
        for slot in self.slots:
            if slot.active and slot.active.cancelled:
                self._finish(slot, "cancelled", events, flush=False)

    def _admit(self, events: list[Event]) -> None:
        while self.waiting:
            free = [s for s in self.slots if s.active is None]
            if not free:
                return
            req, t_received = self.waiting.popleft()
            try:
                active = self._prepare(req, t_received)
            except LlmdError as e:
                events.append(ErrorEvent(req.id, e.to_wire()))
                continue
            except Exception as e:  # a bug or a llama.cpp failure: fail this request, keep serving
                log.exception("preparing request %s failed", req.id)
                events.append(ErrorEvent(req.id, EngineError(f"engine failed to prepare the request: {e}").to_wire()))
                continue
            # the free slot sharing the longest exact prefix; else the least recently used
            if req.cache_prompt:
                slot = max(free, key=lambda s: (s.reusable(active.prompt, self.chunk), -s.last_used))
                reuse = slot.reusable(active.prompt, self.chunk)
                restored = self._from_disk(active.prompt, reuse, min(free, key=lambda s: s.last_used))
                if restored is not None:
                    slot, reuse = restored
            else:
                slot, reuse = min(free, key=lambda s: s.last_used), 0
            self._L.llama_memory_seq_rm(self.mem, slot.seq, reuse, -1)
            del slot.tokens[reuse:]
            slot.tail.clear()
            slot.exact = min(slot.exact, reuse)
            slot.saved = min(slot.saved, reuse)
            active.cached = active.pos = reuse
            active.t_admitted = time.perf_counter()
            slot.active = active

    def _prepare(self, req: GenerationRequest, t_received: float) -> Active:
        if req.messages is not None and not req.raw:
            text = self.template.render(req.messages)
            add_special = self.add_bos and not (self.bos_text and text.startswith(self.bos_text))
        else:
            text = req.prompt or ""
            add_special = self.add_bos
        prompt = self.tokenize(text, add_special)
        if not prompt:
            raise BadRequest("the prompt is empty; send at least one token of text", "prompt")
        n_ctx = min(self.cfg.n_ctx, req.ctx_limit or self.cfg.n_ctx)
        if len(prompt) >= n_ctx:
            raise ContextOverflow(
                f"the prompt is {len(prompt)} tokens but the context holds {n_ctx}: "
                "shorten the prompt or raise the context (LLMD_CTX)",
                "messages" if req.messages is not None else "prompt",
            )
        room = n_ctx - len(prompt)
        if req.max_tokens is not None and req.max_tokens > room:
            raise ContextOverflow(
                f"max_tokens is {req.max_tokens} but the prompt ({len(prompt)} tokens) leaves {room} of the "
                f"{n_ctx}-token context: ask for at most {room} tokens",
                "max_tokens",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else room
        drafters = self.spec.drafters_for(req.speculation)
        sampler = SamplerChain(self.vocab, self.n_vocab, req.sampling, grammar_for(req.response_format))
        active = Active(req, prompt, max_tokens, sampler, TextStream(req.stop), t_received)
        active.drafters = drafters
        return active

    def _prefill_chunk(self, slot: Slot, events: list[Event]) -> None:
        a = slot.active
        assert a is not None
        start = a.pos
        end = min(len(a.prompt), (start // self.chunk + 1) * self.chunk)
        last = end == len(a.prompt)
        with self.profiler.span("prefill"):
            ok = self._run(slot, a.prompt[start:end], start, logits_last=last)
        if not ok:
            self._fail(slot, events, "llama_decode failed during prefill")
            return
        slot.tokens.extend(a.prompt[start:end])
        if end - start == self.chunk and slot.exact == start:
            slot.exact = end
        a.pos = end
        if last:
            a.t_prefill_done = time.perf_counter()
            self._sample(slot, end - start - 1, events)

    def _decode(self, slots: list[Slot], events: list[Event]) -> None:
        """One batch: each decoding slot's pending token, plus its drafts when it speculates.
        Every emitted token is the target's own sample from these logits; a draft is kept only
        while it equals that sample, and the KV of rejected drafts is removed."""
        b = self.batch
        prof = self.profiler
        plan: list[tuple[Slot, int, list[int]]] = []
        with prof.span("draft"):
            spec = [s for s in slots if s.active and s.active.drafters]
            drafts_of = dict(zip((s.seq for s in spec), self.spec.plan([self._job(s) for s in spec], len(slots)),
                                 strict=True))
        with prof.span("batch_build"):
            n = 0
            for slot in slots:
                a = slot.active
                assert a is not None and a.pending is not None
                drafts = drafts_of.get(slot.seq, [])
                pos = len(slot.tokens)
                for j, t in enumerate([a.pending, *drafts]):
                    self._put(n + j, t, pos + j, slot.seq, True)
                plan.append((slot, n, drafts))
                n += 1 + len(drafts)
            b.n_tokens = n
        with prof.span("decode"):
            t0 = time.perf_counter()
            rc = self._L.llama_decode(self.ctx, b)
            self.spec.observe(n, time.perf_counter() - t0)
        if rc != 0:
            for slot in slots:
                self._fail(slot, events, f"llama_decode returned {rc} while decoding")
            return
        for slot, row, drafts in plan:
            a = slot.active
            assert a is not None and a.pending is not None
            slot.tokens.append(a.pending)
            a.pending = None
            accepted = 0
            a.drafted += len(drafts)  # counted before sampling: the last sample may finish the reply
            for j in range(len(drafts) + 1):
                if j > 0:
                    a.accepted += 1
                if not self._sample(slot, row + j, events):
                    break
                if j < len(drafts) and a.pending == drafts[j]:
                    slot.tokens.append(drafts[j])  # its KV is already in place
                    a.pending = None
                    accepted += 1
                    continue
                break
            if drafts:
                self._L.llama_memory_seq_rm(self.mem, slot.seq, len(slot.tokens), -1)
                self.spec.record(a, len(drafts), accepted)

    def _job(self, slot: Slot) -> Job:
        a = slot.active
        assert a is not None and a.pending is not None
        room = min(a.max_tokens - a.n_gen - 1, min(self.cfg.n_ctx, a.req.ctx_limit or self.cfg.n_ctx)
                   - len(slot.tokens) - 2)
        return Job(a, slot.seq, [*slot.tokens, a.pending], room)

    def _measure_cost(self) -> None:
        """Time verifying k drafts on this machine, in an idle slot (when every slot is free)."""
        L = self._L
        scratch = self.slots[-1]
        seq = scratch.seq  # its cached prefix is given up once, for this measurement
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        scratch.tokens.clear()
        scratch.tail.clear()
        scratch.exact = scratch.saved = 0
        base = [self.bos if self.bos >= 0 else 0] * 64
        self._run(scratch, base, 0, logits_last=False)
        for k in (0, 1, 2, 4, 8):
            best = float("inf")
            for _ in range(3):
                for j in range(k + 1):
                    self._put(j, base[j], 64 + j, seq, True)
                self.batch.n_tokens = k + 1
                t0 = time.perf_counter()
                L.llama_decode(self.ctx, self.batch)
                best = min(best, time.perf_counter() - t0)
                L.llama_memory_seq_rm(self.mem, seq, 64, -1)
            self.spec.cost[k] = best
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        log.info("verification cost by draft length (ms): %s",
                 {k: round(v * 1000, 1) for k, v in self.spec.cost.items()})

    def _sample(self, slot: Slot, row: int, events: list[Event]) -> bool:
        """Sample, emit and account one token; True when the request goes on (token pending)."""
        a = slot.active
        assert a is not None
        with self.profiler.span("sample"):
            token = a.sampler.sample(self.ctx, row)
        now = time.perf_counter()
        if a.n_gen == 0:
            a.t_first = now
        a.n_gen += 1
        a.t_last = now
        if self._L.llama_vocab_is_eog(self.vocab, token):
            a.n_gen -= 1  # the end-of-generation token is not part of the reply
            self._finish(slot, "stop", events)
            return False
        with self.profiler.span("detokenize"):
            text, stopped = a.text.push(self._piece(token))
        if text:
            events.append(TokenEvent(a.req.id, text, 1))
        if stopped:
            self._finish(slot, "stop", events, flush=False)
            return False
        if a.n_gen >= a.max_tokens or len(slot.tokens) + 1 >= min(self.cfg.n_ctx, a.req.ctx_limit or self.cfg.n_ctx):
            self._finish(slot, "length", events)
            return False
        a.pending = token
        return True

    def _finish(self, slot: Slot, reason: str, events: list[Event], flush: bool = True) -> None:
        a = slot.active
        assert a is not None
        if flush:
            rest = a.text.flush()
            if rest:
                events.append(TokenEvent(a.req.id, rest, 0))
        t_end = a.t_last or time.perf_counter()
        usage = Usage(
            prompt_tokens=len(a.prompt),
            completion_tokens=a.n_gen,
            cached_tokens=a.cached,
            ttft_s=(a.t_first - a.t_received) if a.t_first else 0.0,
            prefill_s=(a.t_prefill_done - a.t_received) if a.t_prefill_done else 0.0,
            decode_s=(t_end - a.t_first) if a.t_first else 0.0,
            queue_s=(a.t_admitted - a.t_received) if a.t_admitted else 0.0,
            drafted_tokens=a.drafted,
            accepted_tokens=a.accepted,
        )
        events.append(FinalEvent(a.req.id, reason, usage))
        a.sampler.close()
        slot.active = None
        slot.last_used = time.monotonic()
        self.requests_done += 1

    def _fail(self, slot: Slot, events: list[Event], message: str) -> None:
        a = slot.active
        assert a is not None
        events.append(ErrorEvent(a.req.id, EngineError(message).to_wire()))
        a.sampler.close()
        slot.active = None
        # the sequence's KV may be partly written: forget it entirely
        self._L.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
        slot.tokens.clear()
        slot.tail.clear()
        slot.exact = slot.saved = 0

    # ---- the disk prefix cache ------------------------------------------------------------------

    def _from_disk(self, prompt: list[int], live: int, target: Slot) -> tuple[Slot, int] | None:
        """Load the deepest stored prefix of `prompt` into `target` when it beats the live reuse."""
        if self.prefix is None:
            return None
        n_blocks = (len(prompt) - 1) // self.chunk
        if n_blocks * self.chunk <= live:
            return None
        match = self.prefix.lookup(block_hashes(self.ns, prompt[: n_blocks * self.chunk], self.chunk))
        if match is None or match.depth * self.chunk <= live:
            if match is None:
                self.prefix_stats["misses"] += 1
            return None
        n = match.depth * self.chunk
        state = self.prefix.read(match.entry, prompt[:n])
        L = self._L
        L.llama_memory_seq_rm(self.mem, target.seq, -1, -1)
        target.tokens.clear()
        target.tail.clear()
        target.exact = target.saved = 0
        if state is None:
            self.prefix_stats["dropped"] += 1
            return None
        src = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
        if L.llama_state_seq_set_data(self.ctx, src, len(state), target.seq) == 0:
            log.warning("prefix cache: llama.cpp refused entry %s; dropping it", match.entry)
            self.prefix.drop(match.entry)
            self.prefix_stats["dropped"] += 1
            L.llama_memory_seq_rm(self.mem, target.seq, -1, -1)
            return None
        L.llama_memory_seq_rm(self.mem, target.seq, n, -1)
        target.tokens[:] = prompt[:n]
        target.exact = target.saved = n
        self.prefix_stats["hits"] += 1
        self.prefix_stats["tokens_restored"] += n
        return target, n

    def _save(self, slot: Slot) -> None:
        """Queue the slot's exact prefix for the disk cache (the writer thread does the I/O)."""
        n = slot.exact
        L = self._L
        if len(slot.tokens) > n:  # drop the partial tail: it is not exact, so never reused
            L.llama_memory_seq_rm(self.mem, slot.seq, n, -1)
            del slot.tokens[n:]
        slot.tail.clear()
        slot.saved = n
        hashes = block_hashes(self.ns, slot.tokens[:n], self.chunk)
        assert self.prefix is not None and self.writer is not None
        if self.prefix.has(hashes[-1]):
            return
        size = L.llama_state_seq_get_size(self.ctx, slot.seq)
        buf = (ctypes.c_uint8 * size)()
        got = L.llama_state_seq_get_data(self.ctx, buf, size, slot.seq)
        if got:
            self.writer.submit(self.ns, list(slot.tokens[:n]), hashes, bytes(memoryview(buf)[:got]))
            self.prefix_stats["saved"] += 1

    # ---- idle work: make the last reply's KV exact, then save it ---------------------------------

    def _idle_slot(self) -> Slot | None:
        if self.waiting:
            return None
        for slot in self.slots:
            if slot.active is None and slot.exact + self.chunk <= len(slot.tokens) + len(slot.tail):
                return slot
        if self.prefix is not None:
            for slot in self.slots:
                if slot.active is None and slot.exact >= self.cfg.prefix_min_tokens and slot.exact > slot.saved:
                    return slot
        return None

    def _reprefill_chunk(self, slot: Slot) -> None:
        """Recompute one whole chunk past `exact` as prefill would, dropping decode-time KV; or,
        when nothing is left to recompute, save the slot's exact prefix to disk. A command
        arriving from the daemon aborts the decode, so idle work never delays a new request."""
        if slot.exact + self.chunk > len(slot.tokens) + len(slot.tail):
            self._save(slot)
            return
        start = slot.exact
        L = self._L
        if len(slot.tokens) > start:  # decode-time KV past `exact`: drop it, keep its tokens to redo
            slot.tail[:0] = slot.tokens[start:]
            del slot.tokens[start:]
            L.llama_memory_seq_rm(self.mem, slot.seq, start, -1)
        chunk = slot.tail[: self.chunk]
        L.llama_set_abort_callback(self.ctx, self._abort_cb, None)
        try:
            ok = self._run(slot, chunk, start, logits_last=False)
        finally:
            L.llama_set_abort_callback(self.ctx, L.ggml_abort_callback(), None)
        if not ok:  # aborted for a new command (or failed): the tail stays, retried when idle again
            L.llama_memory_seq_rm(self.mem, slot.seq, start, -1)
            return
        slot.tokens.extend(chunk)
        del slot.tail[: self.chunk]
        slot.exact = start + self.chunk

    def _warm_up(self) -> None:
        """One throwaway decode, so buffers are touched and the first request pays no first-call costs."""
        L = self._L
        tok = self.bos if self.bos >= 0 else 0
        self._put(0, tok, 0, 0, True)
        self.batch.n_tokens = 1
        L.llama_decode(self.ctx, self.batch)
        L.llama_memory_seq_rm(self.mem, 0, -1, -1)

    # ---- llama.cpp helpers --------------------------------------------------------------------

    def _put(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        put(self.batch, i, token, pos, seq, logits)

    def _run(self, slot: Slot, tokens: list[int], start: int, logits_last: bool) -> bool:
        n = len(tokens)
        for i, t in enumerate(tokens):
            self._put(i, t, start + i, slot.seq, logits_last and i == n - 1)
        self.batch.n_tokens = n
        return self._L.llama_decode(self.ctx, self.batch) == 0

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        L = self._L
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, True)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, True)
        return list(buf[:n])

    def _piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._L.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._L.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]
