"""The llama.cpp engine: one model, one context with several slots, one step loop.

Each step: release cancelled requests, admit waiting ones into the free slot that already holds
most of their prompt (or restore it from the prefix cache), run one batch, then sample each
slot with its own native sampler chain. Two batching policies (DESIGN: Two batching policies):

- fast (default): one llama_decode per step holding every decoding slot's pending token (and
  drafts), plus prefill tokens of any number of prefilling slots, up to a per-step budget while
  streams run (the whole batch when nothing else does). Prefixes are reused token by token,
  decode-time KV included, from a live slot or the prefix cache.
- exact (LLMD_EXACT=1): prefill only in chunks cut at a fixed grid and after every end-of-turn
  token, each chunk alone in its decode; reuse only whole chunks of prefill-computed KV; idle
  slots re-prefill their replies. Greedy output is then the same whatever is cached or running.
Both keep one KV stream per slot (see __init__ for the measurements).

The engine holds the model, the context, the slots and the step loop; each job of a step is a
room beside it (issue 49): admission.py (waiting requests into slots), prepare.py (a request's
prompt, limits and sampler), step_batch.py (the rows of a step), step_watch.py (when a running
step is given up, and for whom), replies.py (sampling, drafts accepted, finishing), idle_work.py
(what the engine does for itself between requests), and context.py, chunks.py, prefix_cache.py,
kv_copy.py, speculation.py, slots.py, prompt_rows.py.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmd.backends.base import (
    EmbedRequest,
    EmbedResult,
    EngineConfig,
    Event,
    GenerationRequest,
)
from llmd.backends.cpu_board import Claim, board_rank
from llmd.backends.crash_switch import CRASH_ENV
from llmd.backends.llamacpp.admission import Admission
from llmd.backends.llamacpp.batch import put
from llmd.backends.llamacpp.chunks import ChunkGrid
from llmd.backends.llamacpp.context import (
    Decoder,
    flash_attention,
    load_model,
    new_context,
    physical_cores,
    resident_bytes,
    token_piece,
    tokenize,
    warm_up,
)
from llmd.backends.llamacpp.draft_model import DraftModel
from llmd.backends.llamacpp.embeddings import Embedder, grown_size, kv_bytes_per_token
from llmd.backends.llamacpp.growth import grow_in_place
from llmd.backends.llamacpp.healing import Healer
from llmd.backends.llamacpp.idle_work import IdleWork
from llmd.backends.llamacpp.kv_copy import PrefixCopier
from llmd.backends.llamacpp.prefix_cache import Hit, PrefixCache
from llmd.backends.llamacpp.prepare import Preparation
from llmd.backends.llamacpp.prompt_rows import PromptRows
from llmd.backends.llamacpp.replies import Replies
from llmd.backends.llamacpp.slots import Active, Slot
from llmd.backends.llamacpp.speculation import LENGTHS, Job, Speculator
from llmd.backends.llamacpp.step_batch import BatchBuilder, StepBatch
from llmd.backends.llamacpp.step_watch import StepWatch
from llmd.backends.llamacpp.threads import ThreadGovernor
from llmd.backends.profile import Profiler
from llmd.chat.fim import FimTokens
from llmd.chat.formats import detect
from llmd.chat.template import ChatTemplate
from llmd.errors import ContextGrow, EngineError
from llmd.models.memory import available_bytes, kv_refusal
from llmd.priority import class_index
from llmd.priority import rank as priority_rank

log = logging.getLogger("llmd.engine")
PREFILL_THREADS_MIN = 32  # a step with at least this many tokens runs on every thread (_threads_for)
STEP_BACKOFF_MAX_S = 2.0  # the longest pause after engine steps that failed in a row (step)
# Requests sent together reach the engine spread over tens of milliseconds (four clients, each on a
# new connection: 0, 8, 24 and 32 ms), and the first one, alone in an idle engine, was prefilled
# alone while the others waited for that whole step and then took one of their own. For this long
# after the first request of a burst, a step yields to a newcomer (aborted, its KV removed) and
# the next one takes them all: a lone request never waits, a burst loses at most this much work.
JOIN_S = 0.05


def _key(path: str) -> bytes:
    """The prefix cache's HMAC key (the daemon made it); without one, nothing is read from disk."""
    try:
        key = Path(path).read_bytes() if path else b""
    except OSError as e:
        log.warning("prefix cache: cannot read its key %s (%s); the disk tier is off", path, e)
        return b""
    return key if len(key) == 32 else b""


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
        self.exact = cfg.exact
        self.budget = max(1, cfg.prefill_budget)
        rss0 = resident_bytes()
        t0 = time.perf_counter()
        self.model = load_model(cfg.model_path, cfg.gpu_layers, cfg.repack)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        threads = cfg.threads or physical_cores()
        # room for every slot's pending token and longest draft in one batch, whatever LLMD_SLOTS is
        self.n_batch = max(512, cfg.chunk, cfg.n_slots * (1 + max(LENGTHS)))
        # One KV stream per slot, under both policies. Exact needs it: with a unified buffer the same
        # greedy request gave different text depending on which cells it landed in. Fast measured it:
        # with a unified buffer every token attends over the cells of every slot (masked), and since
        # fast keeps each slot's KV for reuse, cold prefill beside three filled slots ran at 169 tok/s
        # unified against 210 per slot; 4-stream decode 110 against 119 tok/s.
        # Attention: flash_attention says which kernel and why; without flash attention each step's
        # rows are cut by the depth they reach, so their scores stay bounded (models/memory.py): a
        # cold prompt read in micro-batches of 512 while short went 1.2-1.3x faster than in the 64
        # a whole 32k slot allows (benchmarks/attention.py --prefill)
        self.flash_attn = flash_attention(cfg.flash_attn, cfg.exact, cfg.gpu_layers)
        self.rows = PromptRows(self.flash_attn, self.n_batch, L.llama_model_n_head(self.model), cfg.n_ctx)
        self.n_ubatch = self.rows.n_ubatch
        self.ctx = new_context(self.model, cfg.n_ctx * cfg.n_slots, self.n_batch, cfg.n_slots, threads,
                               unified=False, n_ubatch=self.n_ubatch, flash_attn=self.flash_attn)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise EngineError(
                f"llama.cpp could not create a context of {cfg.n_ctx * cfg.n_slots} tokens ({cfg.n_slots} slots x "
                f"{cfg.n_ctx}); try a smaller LLMD_CTX or fewer LLMD_SLOTS"
            )
        self.mem = L.llama_get_memory(self.ctx)
        self._can_shift = bool(L.llama_memory_can_shift(self.mem))
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._llama_decode = Decoder(self.ctx, cfg.repack)
        # exact keeps one thread count: llama.cpp's decode logits change with it (a near-tie then
        # flips a greedy answer), and exact promises the same answer whatever else the machine runs
        self.governor = ThreadGovernor(threads, fixed="LLMD_THREADS" if cfg.threads else
                                       "the exact policy: results depend on the thread count" if cfg.exact else "")
        self._batch_threads = threads  # the context's n_threads_batch now (_threads_for)
        self._threads_now = threads  # the contexts' n_threads now (_choose_threads)
        # set by the worker from the CPU board (backends/cpu_board.py): the threads this model may use
        # beside other models' work of the same priority, and why
        self.share: int | None = None
        self.share_reason = ""
        # set by the worker: refreshes this engine's row on the board and says whether another model's
        # work now ranks above all of this one's (a prompt step is then given up between operations)
        self.outranked: Callable[[], bool] | None = None
        # set by the worker: is a request of a class ranked above this on its way (not yet read)?
        self.urgent: Callable[[int], bool] | None = None
        # set by the worker before each step: the most prompt rows a step reads while other models'
        # work contends for the CPU (cpu_board.Turns.step_rows): a held-back model's turn is short, so
        # the more urgent model beside it waits little, and a step given up for it loses little
        self.board_rows: int | None = None
        self.board_turns: Any = None  # the worker's cpu_board.Turns, for stats
        # set by the worker for each embedding request: waits until the board lets it go on
        self.embed_turn: Callable[[], None] | None = None

        self.bos = L.llama_vocab_bos(self.vocab)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos_text = self._piece(self.bos, special=True).decode("utf-8", "replace") if self.bos >= 0 else ""
        eos = L.llama_vocab_eos(self.vocab)
        eos_text = self._piece(eos, special=True).decode("utf-8", "replace") if eos >= 0 else ""
        raw_template = L.llama_model_chat_template(self.model, None)
        self.template = ChatTemplate(raw_template.decode("utf-8") if raw_template else None, self.bos_text, eos_text)
        self.chat_format = detect(self.template.source if not self.template.builtin else None)
        v = self.vocab
        self.healer = Healer(self._piece, self.n_vocab)
        self.fim = FimTokens(L.llama_vocab_fim_pre(v), L.llama_vocab_fim_suf(v), L.llama_vocab_fim_mid(v),
                             L.llama_vocab_fim_rep(v), L.llama_vocab_fim_sep(v))

        between = self.template.between_turns()  # anticipated after each chat reply (fast policy)
        self._next_turn = self.tokenize(between, False) if between else []
        self.slots = [Slot(seq=i) for i in range(cfg.n_slots)]
        self.idle = IdleWork(self)  # what the engine does for itself between requests (idle_work.py)
        self.admission = Admission(self)  # waiting requests into free slots (admission.py)
        self.replies = Replies(self)  # sampling, acceptance, finishing (replies.py)
        self.preparation = Preparation(self)  # a request's prompt, limits and sampler (prepare.py)
        self.batcher = BatchBuilder(self)  # the rows of each step (step_batch.py)
        self.grid = ChunkGrid(cfg.chunk, self._is_eog)
        self.waiting: deque[tuple[GenerationRequest, float]] = deque()
        self.reading: list[tuple[Active, Future[Hit | None]]] = []  # prepared, their prefix being read from disk
        self._failed_steps = 0  # engine steps that failed in a row (step's backoff)
        self._place_raises = os.environ.get(CRASH_ENV) == "place"  # test switch: a placement that fails
        self._step_times: deque[float] = deque(maxlen=256)
        self.requests_done = 0
        self.profiler = Profiler(cfg.profile, nvtx_ranges=cfg.gpu_layers > 0)
        self.interrupt: Callable[[], bool] | None = None  # set by the worker: is a command waiting?
        self.heartbeat: Callable[[], None] | None = None  # set by the worker: "still working" for long calls
        self.watch = StepWatch(self)  # when a running step is given up, and for whom (step_watch.py)
        self._abort_cb = L.ggml_abort_callback(
            lambda _data: bool(self.interrupt and self.interrupt()) or self.watch.board_says_yield())
        self._step_cb = L.ggml_abort_callback(lambda _data: self.watch())
        self.yielded = False  # the last step was given up for a newcomer: the worker waits for it a moment
        self.prefix = (PrefixCache(cfg.prefix_dir, cfg.prefix_max_bytes, cfg.prefix_ram_bytes, cfg.model_digest,
                                   cfg.chunk, cfg.exact, cfg.prefix_min_tokens, _key(cfg.prefix_key_file),
                                   self.flash_attn)
                       if cfg.model_digest else None)
        t_warm = time.perf_counter()
        n_warm = self._warm_up()
        # a first estimate of the prefill cost per token (a cold first decode: on the high side),
        # refined by every prefill step; a KV copy's cost is its source's tokens x these bytes per token
        head = L.llama_model_n_embd(self.model) // max(1, L.llama_model_n_head(self.model))
        kv_token = 2 * 2 * L.llama_model_n_layer(self.model) * L.llama_model_n_head_kv(self.model) * head
        self.copier = PrefixCopier(kv_token, (time.perf_counter() - t_warm) / n_warm)
        self.spec = Speculator(*self._load_draft())
        self.embedder: Embedder | None = None
        self.load_s = time.perf_counter() - t0
        self.rss_load = resident_bytes() - rss0

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
            "policy": "exact" if self.exact else "fast",
            "prefill_budget": self.budget,
            "attention": self.rows.info(),
            "threads": self.governor.most,
            "gpu_layers": min(self.cfg.gpu_layers, int(L.llama_model_n_layer(self.model)))
            if self._L.llama_supports_gpu_offload() else 0,
            "n_layer": int(L.llama_model_n_layer(self.model)),
            "load_s": round(self.load_s, 3),
            "rss_load_bytes": self.rss_load,
            "chat_template": "builtin-chatml" if self.template.builtin else "gguf",
            "tool_format": self.chat_format.tools,
            "fim": not self.fim.missing,
            "pid": os.getpid(),
        }

    def submit(self, req: GenerationRequest) -> None:
        self.waiting.append((req, time.perf_counter()))

    def embed(self, req: EmbedRequest) -> EmbedResult:
        train = int(self._L.llama_model_n_ctx_train(self.model)) or self.cfg.n_ctx
        if self.embedder is None:  # its own context, made at the first embedding request
            self.embedder = self._embedder(min(self.cfg.n_ctx, train), train)
        self._choose_threads()
        try:
            try:
                return self.embedder.embed(req, self.heartbeat, self.embed_turn)
            except ContextGrow as g:  # an input longer than the context it started with
                old = self.embedder
                want = grown_size(old.n_ctx, g.needed, old.ceiling)
                if why := kv_refusal(want * kv_bytes_per_token(self.model), available_bytes()):
                    log.warning("embedding context not grown from %d to %d tokens: %s", old.n_ctx, want, why)
                    old.ceiling = old.n_ctx  # not asked again; the input is refused or cut as before
                else:
                    old.close()
                    self.embedder = self._embedder(want, train)
                    log.info("embedding context grown from %d to %d tokens: an input needed %d",
                             old.n_ctx, want, g.needed)
                return self.embedder.embed(req, self.heartbeat, self.embed_turn)
        finally:
            self.governor.done()

    def _embedder(self, n_ctx: int, train: int) -> Embedder:
        ceiling = min(max(self.cfg.ctx_ceiling, self.cfg.n_ctx), train)
        return Embedder(self.model, self.vocab, n_ctx, self.governor.threads, self.cfg.repack, ceiling)

    def cancel(self, request_id: str) -> None:
        for i, (req, _) in enumerate(self.waiting):
            if req.id == request_id:
                del self.waiting[i]
                return
        for i, (active, _) in enumerate(self.reading):
            if active.req.id == request_id:
                del self.reading[i]
                active.sampler.close()
                return
        for slot in self.slots:
            if slot.active is not None and slot.active.req.id == request_id:
                slot.active.cancelled = True

    def reprioritize(self, request_id: str, priority: str) -> None:
        """Give a request, waiting or admitted, another class (llmd.priority)."""
        self.waiting = deque((replace(r, priority=priority) if r.id == request_id else r, t) for r, t in self.waiting)
        for a in (*(s.active for s in self.slots if s.active), *(a for a, _ in self.reading)):
            if a.req.id == request_id:
                a.req = replace(a.req, priority=priority)

    def has_work(self) -> bool:
        return (bool(self.waiting) or bool(self.reading) or any(s.active for s in self.slots)
                or self.idle.slot() is not None or self.idle.cost_pending())

    def claim(self) -> Claim | None:
        """The most urgent request this engine holds, for the CPU board (None: only idle work)."""
        now = time.perf_counter()
        # a request ages (rises a class per priority.AGING_S) while nothing of it is computed: from
        # its arrival, then from its last step; one that is being served is not starved
        held = [(a.req, a.t_progress or a.t_received)  # as _rank ages them
                for a in (*(s.active for s in self.slots if s.active), *(a for a, _ in self.reading))]
        held += list(self.waiting)
        if not held:
            return None
        # ranked as the board ranks (an aged agent prompt does not outrank a person's chat held here)
        req, since = min(held, key=lambda h: (board_rank(h[0].priority, now - h[1]), h[0].fim is None, h[1]))
        return Claim(req.priority, req.fim is not None, since)

    def _load_draft(self) -> tuple[DraftModel | None, str]:
        """The paired draft model, if any. A draft that fails to load leaves the target serving
        without it; requests asking for 'draft' are then told why."""
        if not self.cfg.draft_path:
            return None, ""
        try:
            return DraftModel(self.cfg.draft_path, self.cfg.n_ctx, self.cfg.n_slots, self.governor.threads, self.n_vocab,
                              self.cfg.repack), ""
        except Exception as e:
            log.warning("draft model %s not loaded: %s", self.cfg.draft_path, e)
            return None, str(e)

    def stats(self) -> dict[str, Any]:
        times = sorted(self._step_times)
        return {
            "slots_busy": sum(1 for s in self.slots if s.active),
            "slots": len(self.slots),
            "waiting": len(self.waiting) + len(self.reading),
            "step_ms_p50": round(times[len(times) // 2] * 1000, 2) if times else None,
            "requests_done": self.requests_done,
            # still to do when idle (snapshots being written included): benchmarks wait for it
            "idle_work": (self.idle.slot() is not None or self.idle.cost_pending()
                          or (self.prefix is not None and self.prefix.writing)),
            "idle": self.idle.stats(self.requests_done),  # what idle work cost (issue 51)
            "threads": {**self.governor.info(), **({"threads": self._threads_now, "reason": self.share_reason}
                                                   if self._threads_now != self.governor.threads else {})},
            "speculation": self.spec.stats(),
            "prefix_cache": self.prefix.info() if self.prefix is not None else {"enabled": False},
            "kv_copies": self.copier.info(),
            **self.watch.info(),  # steps given up: joins, preemptions, yields to urgent requests
            "turns": self.board_turns.turns if self.board_turns is not None else 0,  # held back, its share
            "held_back": self.board_turns.held if self.board_turns is not None else 0,  # paused between steps
            "prompt_step_rows": self.board_rows,  # short steps under contention; None: whole micro-batches
            "profile": self.profiler.summary(),
        }

    def grow(self, n_ctx: int) -> dict[str, Any]:
        """A larger context per slot, weights kept, while no request is in the engine (growth.py)."""
        return grow_in_place(self, n_ctx)

    def clear_caches(self) -> dict[str, Any]:
        if self.prefix is None:
            return {"prefixes_cleared": 0, "namespace": ""}
        return {"prefixes_cleared": self.prefix.clear(), "namespace": self.prefix.ns}

    def close(self) -> None:
        """Save what the prefix cache still wants, wait for its writes, then free everything."""
        L = self._L
        for active, _ in self.reading:
            active.sampler.close()
        self.reading.clear()
        if self.prefix is not None:
            for slot in self.slots:
                if slot.active is None and self.prefix.wants(slot):
                    try:
                        self.prefix.save(L, self.ctx, self.mem, slot)
                    except Exception:
                        log.exception("prefix cache: could not save slot %s at shutdown", slot.seq)
            self.prefix.close()
        for slot in self.slots:
            if slot.active:
                slot.active.sampler.close()
        if self.spec.draft is not None:
            self.spec.draft.close()
        if self.embedder is not None:
            self.embedder.close()
        self.idle.close()
        L.llama_batch_free(self.batch)
        if self.ctx:  # None after a growth that could make no context (growth.py)
            L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    # ---- the step loop ----------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One step of the loop. An unexpected failure in it (a bug, a llama.cpp error) fails the
        requests in the slots, whose KV may be half written, and the engine goes on serving the
        queued and the next ones: a worker that died would take every stream with it. Events
        the step had made before the failure still go out; failures in a row back off (up to
        STEP_BACKOFF_MAX_S), so a fault that repeats neither spins a core nor floods the log."""
        events: list[Event] = []
        try:
            self._step(events)
            self._failed_steps = 0
            return events
        except Exception as e:
            held = [s for s in self.slots if s.active is not None]
            self._failed_steps += 1
            if self._failed_steps <= 3 or self._failed_steps % 100 == 0:
                log.exception("an engine step failed (%d in a row); failing the %d requests it held and serving on",
                              self._failed_steps, len(held))
            for slot in held:
                self.replies.fail(slot, events, f"the engine failed during this request ({type(e).__name__}: {e}); "
                                         "the model goes on serving: retry the request")
            time.sleep(min(STEP_BACKOFF_MAX_S, 0.01 * 2 ** min(self._failed_steps, 10)))
            return events

    def _step(self, events: list[Event]) -> list[Event]:
        t0 = time.perf_counter()
        self._choose_threads()
        self._release_cancelled(events)
        self._admit(events, t0)
        decoding, prefilling = self._schedule(t0)
        if decoding or prefilling:
            self._compute(decoding, prefilling, events)
            self._step_times.append(time.perf_counter() - t0)
        elif self.reading:  # only disk reads in flight: wait a moment for one rather than spin
            wait_futures([f for _, f in self.reading], timeout=0.002, return_when="FIRST_COMPLETED")
        else:
            self.idle.work()
        self.governor.done()
        return events

    def _admit(self, events: list[Event], t0: float) -> None:
        """Waiting requests into free slots; the first of a burst into an idle engine opens the
        window in which its step yields to the others (JOIN_S)."""
        was_idle = not any(s.active for s in self.slots)
        self.admission.admit(events)
        if was_idle and any(s.active for s in self.slots):
            self.watch.join_until = t0 + JOIN_S
        self.yielded = False

    def _schedule(self, now: float) -> tuple[list[Slot], list[Slot]]:
        """The slots this step decodes and the prompts it reads, in order: by priority
        (llmd.priority), an editor's completion first among equals (it is worth something only
        before the next keystroke), then oldest first. A prompt of a lower class than the engine's
        most urgent request waits (a 512-token slice of an agent's prompt beside a chat's 30 took
        the chat's first token from 0.25 s to seconds), aging while it does."""
        ranked = {s.seq: (self._rank(s.active, now), s.active.req.fim is None, s.active.t_received)
                  for s in self.slots if s.active is not None}
        top = min((r[0] for r in ranked.values()), default=0)
        prefilling = sorted((s for s in self.slots if s.active and s.active.prefilling and ranked[s.seq][0] <= top),
                            key=lambda s: ranked[s.seq])
        decoding = [s for s in self.slots if s.active and not s.active.prefilling]
        return decoding, prefilling

    def _compute(self, decoding: list[Slot], prefilling: list[Slot], events: list[Event]) -> None:
        """The step's decodes: one for all (fast), or under the exact policy one aligned prompt
        chunk alone in its decode, so its KV is the same whatever else runs, then the streams."""
        if not self.exact:
            self._run_step(decoding, prefilling, events)
            return
        if prefilling:
            self._run_step([], prefilling[:1], events)
        if decoding:
            self._run_step(decoding, [], events)

    @staticmethod
    def _rank(a: Active, now: float) -> int:
        """llmd.priority's rank of an admitted request: it ages while nothing of it is computed."""
        return priority_rank(a.req.priority, now - (a.t_progress or a.t_received))

    def _choose_threads(self) -> None:
        """Fewer threads while other programs keep cores busy, all of them again when they stop
        (threads.py): llama.cpp takes a new count between decodes."""
        self.governor.check()
        n = self.governor.threads if self.share is None or self.exact else min(self.share, self.governor.threads)
        if n == self._threads_now:
            return
        self._threads_now = n
        L = self._L
        for ctx in (self.ctx, self.spec.draft.ctx if self.spec.draft else None,
                    self.embedder.ctx if self.embedder else None):
            if ctx is not None:
                L.llama_set_n_threads(ctx, n, n)
        self._batch_threads = n

    def _threads_for(self, n_tokens: int) -> None:
        """A step with a prefill chunk keeps every thread even on a busy machine: its long matrix
        products meet at few barriers (measured with one or two cores busy elsewhere: as fast as
        or faster than one thread), while decode rows meet at one per operation. llama.cpp runs any
        batch of more than one token with n_threads_batch, so it is set per step."""
        most = self.governor.most if self.share is None or self.exact else min(self.share, self.governor.most)
        want = most if n_tokens >= PREFILL_THREADS_MIN else self._threads_now
        if want != self._batch_threads:
            self._L.llama_set_n_threads(self.ctx, self._threads_now, want)
            self._batch_threads = want

    def _release_cancelled(self, events: list[Event]) -> None:
        for slot in self.slots:
            if slot.active and slot.active.cancelled:
                a = slot.active
                # how far it had come: the daemon logs a cancelled request without usage, and a prompt
                # cut while being read (a client's time limit) says here whether it was read at speed
                log.info("request %s cancelled after %.1f s: prompt at %d of %d tokens (%d from cache), %d generated",
                         a.req.id, time.perf_counter() - a.t_received, min(a.pos, len(a.prompt)), len(a.prompt),
                         a.cached, a.n_gen)
                self.replies.finish(slot, "cancelled", events, flush=False)

    def _run_step(self, decoding: list[Slot], prefilling: list[Slot], events: list[Event]) -> None:
        """One llama_decode: each decoding slot's pending token (plus its drafts when it
        speculates), then prefill tokens of the prefilling slots (step_batch.py). Every emitted
        token is the target's own sample from these logits; a draft is kept only while it equals
        that sample, and the KV of rejected drafts is removed (replies.py)."""
        t_step = time.perf_counter()
        lone = decoding[0].active if len(decoding) == 1 else None
        lone_gen = lone.n_gen if lone is not None else 0
        b = self.batcher.build(decoding, prefilling)
        self._threads_for(b.n)
        # (exact prefills one chunk a step, oldest first: a newcomer could not share it)
        joinable = not self.exact and t_step < self.watch.join_until and self.interrupt is not None
        rc = self._decode_watched(b, joinable)
        if rc == 2 and (joinable or self.watch.preempting):
            self._give_up(b)
            return
        if rc != 0:
            for slot in b.slots:
                self.replies.fail(slot, events, f"llama_decode returned {rc} for a batch of {b.n} tokens")
            return
        self.replies.after_step(b, events)
        if lone is not None and not b.parts:  # a lone stream: what each drafter gains, measured live
            self.spec.note_lone_step(lone.last_drafter if b.plan[0][2] else "", lone.n_gen - lone_gen,
                                     time.perf_counter() - t_step)

    def _decode_watched(self, b: StepBatch, joinable: bool) -> int:
        """The step's llama_decode. A prompt's step is watched between its graph operations (a Python
        call each: a few ms a step, too much for a decode alone of ~40 ms, nothing beside a prefill's
        seconds); it is given up for a request of a class above its prompts' (step_watch.py)."""
        watched = joinable or bool(b.parts)
        with self.profiler.span("prefill" if b.parts else "decode"):
            t0 = time.perf_counter()
            if watched:
                # by class, not aged rank: an aged prompt gives its step up too, and keeps the
                # micro-batches it finished, so it still goes on (an agent's aged prompt held a
                # chat's first token for a whole 512-row step)
                self.watch.start(joinable, min((class_index(p[0].active.req.priority) for p in b.parts
                                                if p[0].active), default=None))
                self._L.llama_set_abort_callback(self.ctx, self._step_cb, None)
            try:
                rc = self._decode()
            finally:
                if watched:
                    self._L.llama_set_abort_callback(self.ctx, self._L.ggml_abort_callback(), None)
            spent = time.perf_counter() - t0 - (self.watch.step_held_s if watched else 0.0)  # held: not compute
            if rc == 0 and b.plan and not b.parts:
                self.spec.observe(b.n, spent)
            elif rc == 0 and b.parts and not b.plan:
                self.copier.observe_prefill(b.n, spent)
        return rc

    def _give_up(self, b: StepBatch) -> None:
        """A step given up for a request that arrived with these (none of its KV stays: they share
        the next step), or for more urgent work (another model's, or a request on its way here):
        llama.cpp keeps the micro-batches it finished, and a prompt keeps them (the exact policy's
        chunks are computed whole)."""
        w = self.watch
        keep = w.preempting and not self.exact
        for slot, _, pos, end in b.rows:
            kept = self._kept_of_prompt(slot, pos, end) if keep and end >= 0 else pos
            self._L.llama_memory_seq_rm(self.mem, slot.seq, kept, -1)
        # for a request on its way the worker waits a moment for it, as for a join
        self.yielded = not w.preempting or w.for_newcomer
        if w.preempting:
            w.given_up()
        else:
            w.joins += 1

    def _kept_of_prompt(self, slot: Slot, pos: int, end: int) -> int:
        """After a prompt step given up part way: where the prompt's KV now ends (what llama.cpp
        kept of rows pos..end), its tokens recorded in the slot. Never the prompt's last rows: the
        step that computes them also samples (PromptRows.last_rows)."""
        a = slot.active
        assert a is not None
        kept = min(end, int(self._L.llama_memory_seq_pos_max(self.mem, slot.seq)) + 1,
                   len(a.prompt) - self.rows.last_rows)
        if kept <= pos:
            return pos
        slot.tokens.extend(a.prompt[pos:kept])
        self.watch.kept += kept - pos
        a.pos = kept
        a.t_progress = time.perf_counter()
        return kept

    def _reusable(self, slot: Slot, prompt: list[int]) -> int:
        return slot.reusable(prompt, self.chunk, self.exact, self._is_eog)

    def _is_eog(self, token: int) -> bool:
        return bool(self._L.llama_vocab_is_eog(self.vocab, token))

    def _job(self, slot: Slot) -> Job:
        a = slot.active
        assert a is not None and a.pending is not None
        room = min(a.max_tokens - a.n_gen - 1, a.n_ctx - len(slot.tokens) - 2)
        return Job(a, slot.seq, [*slot.tokens, a.pending], room)

    def _warm_up(self) -> int:
        """Run every kernel a request will, so one that crashes does so while loading (context.warm_up).
        Returns the tokens it prefilled."""
        n = min(self.n_batch, max(64, self.chunk))
        if not warm_up(self._llama_decode, self.batch, self.mem, n, len(self.slots), self.n_vocab):
            raise EngineError(f"llama.cpp failed its warm-up decode of {self.cfg.model_name}")
        return n

    # ---- llama.cpp helpers --------------------------------------------------------------------

    def _run(self, slot: Slot, tokens: list[int], start: int, logits_last: bool) -> bool:
        n = len(tokens)
        for i, t in enumerate(tokens):
            put(self.batch, i, t, start + i, slot.seq, logits_last and i == n - 1)
        self.batch.n_tokens = n
        return self._decode() == 0

    def _decode(self) -> int:
        """One llama_decode of the batch; it applies every pending K-shift (Slot.shift_pending)."""
        rc = self._llama_decode(self.batch)
        for s in self.slots:
            s.shift_pending = False
        return rc

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        return tokenize(self.vocab, text, add_special, parse_special)

    def _piece(self, token: int, special: bool = False) -> bytes:
        return token_piece(self.vocab, token, special)
