"""A request made ready for a slot (issue 49: out of engine.py): its prompt tokens (a chat rendered
and fitted by llmd.chat, an editor's fill-in-the-middle healed at its cut, or raw text), its
limits within the context, its sampler and grammar, its drafters. Refusals name what to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmd.backends.base import GenerationRequest
from llmd.backends.llamacpp.grammar import grammar_for, grammar_for_tools
from llmd.backends.llamacpp.sampler import SamplerChain
from llmd.backends.llamacpp.slots import Active
from llmd.backends.llamacpp.text import TextStream
from llmd.chat.fim import Cut, healed_fim_tokens, middle_start
from llmd.chat.fit import fit_by_dropping
from llmd.chat.tools import prepare_tools
from llmd.errors import BadRequest, ContextGrow, ContextOverflow

if TYPE_CHECKING:
    from llmd.backends.llamacpp.engine import LlamaCppEngine


# The room for a reply a grown context leaves after the prompt (less when the request asks for less)
GROW_REPLY_ROOM = 2048


class Preparation:
    def __init__(self, engine: LlamaCppEngine) -> None:
        self.e = engine

    def chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        e = self.e
        return e.template.tokens(messages, tools, e.tokenize, e.add_bos)

    def prepare(self, req: GenerationRequest, t_received: float) -> Active:
        e = self.e
        grammar, trigger = grammar_for(req.response_format), ""
        n_ctx = min(e.cfg.n_ctx, req.ctx_limit or e.cfg.n_ctx)
        dropped, healed, fim_head = 0, -1, None
        if req.messages is not None and not req.raw:
            messages, tools, constraint = prepare_tools(e.chat_format, req)
            if constraint is not None:
                grammar, trigger = grammar_for_tools(constraint), constraint.trigger
            prompt = self.chat_tokens(messages, tools)
            self._grow_if_needed(req, len(prompt), n_ctx, "messages")
            if len(prompt) >= n_ctx and req.drop_old_messages:
                dropped, prompt = fit_by_dropping(messages, tools, n_ctx, req.max_tokens, len(prompt), self.chat_tokens)
        elif req.fim is not None:
            if e.fim.missing:
                raise BadRequest(f"{e.cfg.model_name} cannot fill in the middle: its vocabulary has no "
                                 f"{', '.join(e.fim.missing)} token; use a FIM model (Qwen2.5-Coder, StarCoder2, "
                                 "CodeLlama, DeepSeek-Coder...)", "suffix")
            fim = req.fim
            heads = [s.fim_head[0] for s in e.slots
                     if s.fim_head is not None and s.fim_head[1:] == (fim.suffix, fim.extra)]
            middle = middle_start(fim, heads) if req.cache_prompt else fim.prefix.rfind("\n") + 1
            prompt, healed = healed_fim_tokens(fim, e.fim, lambda t: e.tokenize(t, False, parse_special=False),
                                               [e.bos] if e.add_bos else [], cut=middle)
            fim_head = (fim.prefix[:middle], fim.suffix, fim.extra)
        else:
            prompt = e.tokenize(req.prompt or "", e.add_bos)
        if not prompt:
            raise BadRequest("the prompt is empty; send at least one token of text", "prompt")
        self._grow_if_needed(req, len(prompt), n_ctx, "messages" if req.messages is not None else "prompt")
        if len(prompt) >= n_ctx:
            grows = (f" (and grows to at most {e.cfg.ctx_ceiling} on this machine)"
                     if e.cfg.ctx_ceiling > n_ctx and n_ctx == e.cfg.n_ctx else "")
            raise ContextOverflow(
                f"the prompt is {len(prompt)} tokens but the context holds {n_ctx}{grows}: "
                "shorten the prompt or raise the context (LLMD_CTX)",
                "messages" if req.messages is not None else "prompt",
            )
        # max_tokens is an upper bound, as llama-server and Ollama treat it: a reply that reaches the
        # end of the context ends there with finish_reason "length"
        room = n_ctx - len(prompt)
        max_tokens = min(req.max_tokens, room) if req.max_tokens is not None else room
        drafters = e.spec.drafters_for(req.speculation)  # refuses before a native sampler is made
        sampler = SamplerChain(e.vocab, e.n_vocab, req.sampling, grammar, trigger)
        cut = Cut(req.fim.n_indent, req.fim.t_max_predict_ms) if req.fim is not None else None
        active = Active(req, prompt, max_tokens, sampler, TextStream(req.stop, cut), t_received, n_ctx=n_ctx,
                        dropped=dropped)
        active.drafters = drafters
        active.auto = req.speculation in ("auto", "")
        if fim_head is not None:
            active.fim_head = fim_head
            if healed >= 0:
                active.heal = e._piece(healed)
        return active

    def _grow_if_needed(self, req: GenerationRequest, n_prompt: int, n_ctx: int, param: str) -> None:
        """ContextGrow when the prompt and room for its reply need more than the slot holds and the
        model may grow to hold them (its context is sized by use: memory.starting_ctx), unless the
        request bounds its own context below the slot's (Ollama's num_ctx) or growth was refused."""
        e = self.e
        ceiling = e.cfg.ctx_ceiling
        if req.no_grow or ceiling <= e.cfg.n_ctx or n_ctx < e.cfg.n_ctx or n_prompt >= ceiling:
            return
        need = min(ceiling, n_prompt + min(req.max_tokens or GROW_REPLY_ROOM, GROW_REPLY_ROOM))
        if need > n_ctx:
            raise ContextGrow(f"the prompt is {n_prompt} tokens and the context holds {n_ctx}: growing it to "
                              f"hold {need}", param, need)
