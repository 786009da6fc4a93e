"""A larger context per slot in place, the weights kept (issue 48: a context sized by use grew by
loading the model again: 4.3 s for the 1.5B on two cores, its in-memory prefix cache lost, and a
new worker that the desktop counted as a reload).

Only between steps with no request in the engine (the daemon waits for the model's other requests
and holds new ones). Each slot's KV is read out, the context freed, a larger one made and warmed
up, and the KV written back, so a slot holding an agent's long prefix still serves its next turn.
The draft model's context grows with it (its sequences catch up when it next drafts).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from llmd.backends.llamacpp.context import Decoder, new_context, warm_up
from llmd.backends.llamacpp.prompt_rows import PromptRows
from llmd.errors import EngineError

if TYPE_CHECKING:
    from llmd.backends.llamacpp.engine import LlamaCppEngine

log = logging.getLogger("llmd.engine")
WARM_ROWS = 16


def _read_out(L: Any, ctx: Any, seq: int) -> Any:
    """A sequence's KV state as bytes (None when llama.cpp gives none)."""
    size = L.llama_state_seq_get_size(ctx, seq)
    if not size:
        return None
    buf = (ctypes.c_uint8 * size)()
    got = L.llama_state_seq_get_data(ctx, buf, size, seq)
    return (buf, got) if got else None


def grow_in_place(e: LlamaCppEngine, n_ctx: int) -> dict[str, Any]:
    """Make `e`'s context `n_ctx` tokens per slot; the engine's info after. EngineError when it is
    busy, or when llama.cpp cannot make the larger context (the old size is made again: the
    engine serves on as before, and the daemon loads the model again instead)."""
    if e.waiting or e.reading or any(s.active for s in e.slots):
        raise EngineError(f"{e.cfg.model_name} has requests in it; its context grows only when it has none")
    if n_ctx <= e.cfg.n_ctx:
        return e.info()
    L = e._L
    kept = {}
    for slot in e.slots:
        if slot.tokens and not slot.shift_pending:
            state = _read_out(L, e.ctx, slot.seq)
            if state is not None:
                kept[slot.seq] = state
        if slot.seq not in kept:
            slot.forget(L, e.mem)
        slot.shift_pending = False
    old = e.cfg.n_ctx
    L.llama_free(e.ctx)
    e.ctx = None
    why = ""
    ctx = _context(e, n_ctx)
    if not ctx:
        why = f"llama.cpp could not make a context of {n_ctx * len(e.slots)} tokens"
        n_ctx = old
        ctx = _context(e, old)
        if not ctx:
            raise EngineError(f"{why}, nor the {old} tokens a slot had: the model must be loaded again")
    _use(e, ctx, n_ctx)
    for slot in e.slots:
        state = kept.get(slot.seq)
        if state is not None and not L.llama_state_seq_set_data(e.ctx, state[0], state[1], slot.seq):
            slot.forget(L, e.mem)
    if e.spec.draft is not None:
        try:
            e.spec.draft.resize(n_ctx, len(e.slots))
            L.llama_set_n_threads(e.spec.draft.ctx, e._threads_now, e._threads_now)
        except EngineError as err:  # the target serves on without speculation by the draft model
            log.warning("%s: the draft model's context did not grow (%s); going on without it", e.cfg.model_name, err)
            e.spec.draft.close()
            e.spec.draft, e.spec.draft_error = None, f"its context did not grow with the target's: {err}"
    if why:
        raise EngineError(why)
    log.info("%s: context grown in place from %d to %d tokens per slot (%d slots' KV kept)",
             e.cfg.model_name, old, n_ctx, len(kept))
    return e.info()


def _context(e: LlamaCppEngine, n_ctx: int) -> Any:
    return new_context(e.model, n_ctx * len(e.slots), e.n_batch, len(e.slots), e.governor.threads,
                       unified=False, n_ubatch=e.n_ubatch, flash_attn=e.flash_attn)


def _use(e: LlamaCppEngine, ctx: Any, n_ctx: int) -> None:
    """The engine on `ctx`: its memory, decoder, row rules and thread counts, warmed up."""
    L = e._L
    e.ctx = ctx
    e.cfg = replace(e.cfg, n_ctx=n_ctx)
    e.mem = L.llama_get_memory(ctx)
    e._llama_decode = Decoder(ctx, e.cfg.repack)
    e.rows = PromptRows(e.flash_attn, e.n_batch, L.llama_model_n_head(e.model), n_ctx)
    L.llama_set_n_threads(ctx, e._threads_now, e._batch_threads)
    # a short warm-up: the kernels ran at load (a crash there was caught then), so this only has
    # llama.cpp set up the new context's buffers before a request's first step (512 rows cost the
    # 1.5B 5 s on two cores)
    if not warm_up(e._llama_decode, e.batch, e.mem, WARM_ROWS, len(e.slots), e.n_vocab):
        raise EngineError(f"llama.cpp failed a decode in {e.cfg.model_name}'s grown context")
