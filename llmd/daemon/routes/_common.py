"""What the API adapters share: body parsing into pydantic models with 400s that name the
field, and running a request so that errors before the first token get a proper status."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from llmd.backends.base import Event, FinalEvent, GenerationRequest, TokenEvent, Usage
from llmd.backends.repack import llama_cpp_version
from llmd.chat.fim import spellings_in_vocab
from llmd.chat.formats import STRUCTURED, ChatFormat, detect
from llmd.chat.schema import MAX_BOUND, loosen
from llmd.daemon.apps_seen import app_name, printable
from llmd.daemon.arrivals import admission_of
from llmd.daemon.response_cache import Cached, cache_key, cacheable
from llmd.daemon.scheduler import Admission
from llmd.daemon.suggestions import Proposal
from llmd.errors import BadRequest, ClientGone, LlmdError
from llmd.models.hub import is_hub_ref
from llmd.priority import classify

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
_log = logging.getLogger("llmd.requests")

# A stream's status waits this long for the request's first event, so that bad input is still a
# 4xx (the engine refuses it as it prepares, within milliseconds when idle); past it (a model
# loading, a long prompt being read) the stream starts and a keep-alive goes out every
# KEEPALIVE_S until the first token, so no client sits on a silent connection for minutes
# (Codex gives up on a stream idle for 300 s, counting events only: the Responses route sends an
# event, the others an SSE comment; an 8.6k-token prompt takes 220-410 s on two cores).
FIRST_EVENT_WAIT_S = 10.0
PROPOSE_TOKENS = 64  # at most this many more tokens of a FIM completion decoded on past the reply
KEEPALIVE_S = 10.0


class KeepAlive:
    """What a Run yields while a streamed request's first event is still coming (see above)."""


KEEPALIVE = KeepAlive()


async def parse_body(request: Request, model: type[M], nulls_are_unset: bool = False) -> M:
    """The body validated as `model`; with `nulls_are_unset`, a top-level JSON null means "not sent"
    (OpenAI's spec allows null for every optional field, and clients send it)."""
    raw = await request.body()
    if not raw.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    if nulls_are_unset:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            data = None  # reported as invalid JSON below (pydantic's parser names the depth)
        if isinstance(data, dict) and None in data.values():
            raw = json.dumps({k: v for k, v in data.items() if v is not None}).encode()
    try:
        body = model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "json_invalid":
            raise BadRequest(f"the request body is not valid JSON: {err['msg']}") from None
        if err["type"] == "model_type":
            raise BadRequest("the request body must be a JSON object") from None
        raise BadRequest(f"field {loc!r}: {err['msg']}" + (f" (got {err['input']!r})" if _short(err) else ""), loc) from None
    _check_extras(request, body)
    return body


# Fields that would change the reply and that llmd does not do: refused, never silently dropped.
REFUSED = {
    "logit_bias": "llmd does not bias logits; leave logit_bias out",
    "audio": "llmd's models are text-only; leave audio out",
    "prediction": "llmd speculates on its own (speculation: ngram | draft); leave prediction out",
    "web_search_options": "llmd has no web search; leave web_search_options out",
    "functions": "the legacy functions field is not served; send tools instead",
    "function_call": "the legacy function_call field is not served; send tools and tool_choice instead",
    "best_of": "llmd returns one completion per request; leave best_of out",
    "echo": "llmd does not echo the prompt; leave echo out",
    "images": "the loaded models are text-only; leave images out",
}
# Fields that do not change the reply (bookkeeping, hints for hosted services): ignored on purpose,
# listed in README; anything else unknown is ignored too but named in X-LLMD-Ignored and the log.
IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
           "prompt_cache_retention", "parallel_tool_calls", "reasoning_effort", "verbosity", "include",
           "background", "reasoning", "context_management", "cache_control", "container", "diagnostics",
           "inference_geo", "speed", "user_profile_id", "workspace_id", "thinking", "think",
           "modalities", "truncate", "keep_alive", "options", "stream_options", "top_logprobs"}
_seen_unknown: set[str] = set()


def _check_extras(request: Request, body: BaseModel) -> None:
    extra = body.model_extra or {}
    for name, value in extra.items():
        if name in REFUSED and value not in (None, False, {}, [], ""):
            raise BadRequest(f"{name}: {REFUSED[name]}", name)
    if extra.get("modalities") not in (None, ["text"]):
        raise BadRequest("modalities: llmd answers text only; send [\"text\"] or leave it out", "modalities")
    # llmd's priority class (llmd.priority), as the body may say it; an integer is vLLM's own
    # field (lower runs first), which names no class: ignored, and said so like any unknown field
    asked = extra.get("priority")
    if isinstance(asked, str):
        request.state.priority_asked = asked
    # named in a header: only printable ASCII goes in one (others become ?), and only a few names
    unknown = sorted(printable(n, 40)
                     for n in extra if n not in IGNORED and n not in REFUSED
                     and not (n == "priority" and isinstance(asked, str)))[:16]
    if unknown:
        request.state.ignored = unknown
        new = [n for n in unknown if n not in _seen_unknown]
        if new:
            _seen_unknown.update(new)
            _log.info("ignoring request fields llmd does not know: %s (named in X-LLMD-Ignored)", ", ".join(new))


def _short(err: Any) -> bool:
    v = err.get("input")
    return isinstance(v, str | int | float | bool) and len(repr(v)) < 80


def client_of(request: Request) -> str:
    """Which client sent a request, as far as a local server can tell: its User-Agent (an editor's
    extension, a library and its version), bounded; what is learned of one client's behaviour
    (daemon.suggestions) is applied to that client only."""
    return printable(request.headers.get("user-agent", ""), 120)


def canonical_name(registry: Any, name: str) -> str:
    """Ollama's `name:latest` is the model registered as `name`, and `hf.co/USER/REPO:QUANT` the
    model pulled by it (one worker, one cache key)."""
    if name.endswith(":latest") and not registry.has(name):
        return name[: -len(":latest")]
    if is_hub_ref(name) and not registry.has(name):
        try:  # a pulled model answers to the Hub reference it was pulled by
            return str(registry.get(name)["name"])
        except LlmdError:
            return name
    return name


def text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise BadRequest(f"{where}.content[{i}] is a {part.type!r} part; llmd accepts text parts only", f"{where}.content")
        out.append(part.text)
    return "".join(out)


@dataclass
class Run:
    """One request in flight: the first event already awaited, the rest streamed."""

    req: GenerationRequest
    model: str
    events: AsyncIterator[Event]
    first: Event | None  # None while `pending` (a stream that started before its first event)
    t_start: float
    admission: Admission = field(default_factory=Admission)
    cache: str = "bypass"  # X-LLMD-Cache: hit | miss | bypass
    cache_key: str | None = None
    text: list[str] = field(default_factory=list)
    final: FinalEvent | None = None
    request: Request | None = None  # to notice a client that hangs up on a non-streamed reply
    on_done: Any = None  # called once with the Run after a complete reply
    api: str = "openai"
    metrics: Any = None
    t_first: float | None = None
    gaps: list[float] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprob per sampled token, when asked for
    tool_calls: list[Any] = field(default_factory=list)  # StructuredCall: calls a remote upstream parsed
    backend: str = "llama.cpp"  # the engine that serves the model (metric label, cache key)
    pending: asyncio.Future[Event] | None = None  # the first event, when the stream started without it
    proposal: Proposal | None = None  # a FIM completion: kept for the next keystroke (daemon.suggestions)
    reply_len: int | None = None  # pieces of `text` that are the reply, when the engine decoded on past it
    end: FinalEvent | None = None  # the engine's own end (`final` is the reply's, which may come before)
    priority_reason: str = ""  # why the request got its class (llmd.priority)

    def __aiter__(self) -> AsyncIterator[Event | KeepAlive]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Event | KeepAlive]:
        outcome = "cancelled"
        last = 0.0
        try:
            while self.first is None:
                assert self.pending is not None
                await asyncio.wait({self.pending}, timeout=KEEPALIVE_S)
                if self.pending.done():
                    self.first = self.pending.result()  # an error here is reported in the stream
                else:
                    yield KEEPALIVE
            ev: Event | None = self.first
            while ev is not None:
                if isinstance(ev, TokenEvent):
                    now = time.perf_counter()
                    if self.t_first is None:
                        self.t_first = now
                    elif ev.text:
                        self.gaps.append(now - last)
                    last = now
                    self.text.append(ev.text)
                    self.logprobs.extend(ev.logprobs)
                    self.tool_calls.extend(ev.tool_calls)
                    if ev.reply_end is not None:  # the reply ends here; the rest is the proposal's
                        self.reply_len, self.final = len(self.text), FinalEvent(self.req.id, "length", ev.reply_end)
                    if self.proposal is not None:
                        self.proposal.changed()
                elif isinstance(ev, FinalEvent):
                    self.end = ev
                    if self.final is None:
                        self.final = ev
                yield ev
                if self.end is not None:
                    outcome = "ok"
                    if self.on_done is not None:
                        asyncio.get_running_loop().call_soon(self.on_done, self)
                    return
                ev = await self.events.__anext__()
        except Exception:
            outcome = "error"
            raise
        finally:
            if self.proposal is not None:
                self.proposal.finish(self.end is not None and self.end.finish_reason in ("stop", "length"))
            if self.pending is not None and not self.pending.done():  # the client left while waiting
                self.pending.cancel()
                with contextlib.suppress(BaseException):
                    await self.pending
            await self.events.aclose()  # type: ignore[attr-defined]
            if self.metrics is not None:
                end = time.perf_counter()
                ttft = self.t_first - self.t_start if self.t_first is not None else None
                u = self.final.usage if self.final else None
                app = (app_name(self.request.headers, self.request.app.state.token)
                       if self.request is not None else "(llmd)")
                if self.request is not None:
                    self.request.app.state.apps_seen.record(app, self.model, end - self.t_start,
                                                            (u.prompt_tokens + u.completion_tokens) if u else 0,
                                                            priority=self.req.priority)
                _log.info("request", extra={
                    "request_id": self.req.id, "model": self.model, "api": self.api, "outcome": outcome, "app": app,
                    "priority": self.req.priority, "priority_reason": self.priority_reason,
                    "cache": self.cache, "ttft_s": ttft, "duration_s": end - self.t_start,
                    "finish_reason": self.final.finish_reason if self.final else None,
                    "prompt_tokens": u.prompt_tokens if u else None, "cached_tokens": u.cached_tokens if u else None,
                    "completion_tokens": u.completion_tokens if u else None,
                    # pieces of text sent, whatever the outcome: how far a cancelled reply had run
                    "streamed_pieces": len(self.text),
                    "dropped_messages": u.dropped_messages if u else None,
                    # where the first token's time went, as the engine measured it
                    "queue_s": round(u.queue_s, 4) if u else None, "prefill_s": round(u.prefill_s, 4) if u else None,
                    "engine_ttft_s": round(u.ttft_s, 4) if u else None})
                self.metrics.observe(self.model, self.api, outcome, ttft, self.gaps, end - self.t_start,
                                     self.final.usage if self.final else None, self.cache, self.backend)

    @property
    def answered_by(self) -> str:
        """The model whose output this reply is: a remote model's local fallback when it answered
        (its text is parsed in that model's own chat format)."""
        if self.admission.fallback and self.request is not None:
            spec = json.loads(self.request.app.state.registry.get(self.model).get("remote") or "{}")
            return str(spec.get("fallback") or self.model)
        return self.model

    @property
    def dropped(self) -> int:
        """Old messages the engine left out to fit the context; its first event says (drop_old_messages)."""
        first = self.first
        if isinstance(first, TokenEvent):
            return first.dropped_messages
        return first.usage.dropped_messages if isinstance(first, FinalEvent) else 0

    @property
    def headers(self) -> dict[str, str]:
        out = {"X-LLMD-Cache": self.cache}
        if self.admission.fallback and self.request is not None:
            out["X-LLMD-Fallback"] = f"{self.answered_by} (every upstream of {self.model} is down)"
        if self.dropped:
            out["X-LLMD-Dropped-Messages"] = str(self.dropped)
        ignored = getattr(self.request.state, "ignored", None) if self.request is not None else None
        if ignored:
            out["X-LLMD-Ignored"] = ", ".join(ignored)
        return out

    async def drain(self) -> None:
        async for _ in self:
            pass

    async def collect(self, request: Request | None = None) -> tuple[str, FinalEvent]:
        """The whole reply. With `request`, a client that hangs up before it is done cancels the
        generation (as a closed stream does), instead of leaving it to run for nobody; but a FIM
        completion runs on for a moment, for the editor's next keystroke (daemon.suggestions)."""
        if request is None:
            await self.drain()
        elif self.proposal is not None:
            task = asyncio.ensure_future(self.drain())
            try:
                await while_connected(request, self._reply(task))
            except ClientGone:  # its editor's next keystroke came (daemon.suggestions learns when)
                request.app.state.suggestions.dropped(self.model, client_of(request),
                                                      time.perf_counter() - self.t_start)
                raise
            finally:
                if not task.done():  # the client left, or has its reply: the rest is the proposal's
                    self.proposal.run_on(task)
        else:
            await while_connected(request, self.drain())
        assert self.final is not None
        return self.reply_text, self.final

    async def _reply(self, task: asyncio.Future[None]) -> None:
        """Until the reply is complete: the engine's end, or where it said the reply ends (a FIM
        proposal decodes on past it)."""
        assert self.proposal is not None
        while self.final is None and not task.done():
            change = self.proposal.next_change()
            waits: set[asyncio.Future[object]] = {task, change}  # type: ignore[arg-type]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                change.cancel()
        if self.final is None:
            task.result()  # its error

    @property
    def reply_text(self) -> str:
        return "".join(self.text if self.reply_len is None else self.text[:self.reply_len])

    @property
    def usage(self) -> Usage:
        assert self.final is not None
        return self.final.usage


async def while_connected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled, with ClientGone, the moment the client hangs up (an editor
    cancels its request at the next keystroke: its slot is free at the engine's next step)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone("the client closed the connection; the request was cancelled")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (its body is read: what comes next can only be that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _replay(req: GenerationRequest, hit: Cached) -> AsyncIterator[Event]:
    # the first event says which old messages were left out to fit, as the computed reply's did
    dropped = hit.usage.dropped_messages
    for i, piece in enumerate(hit.pieces):
        yield TokenEvent(req.id, piece, 1, dropped_messages=dropped if i == 0 else 0)
    if hit.tool_calls:
        yield TokenEvent(req.id, "", 0, tool_calls=hit.tool_calls, dropped_messages=0 if hit.pieces else dropped)
    # the hit's own timings (it computed nothing), not those of the request that filled the cache
    yield FinalEvent(req.id, hit.finish_reason, replace(hit.usage, ttft_s=0.0, prefill_s=0.0, decode_s=0.0,
                                                        queue_s=0.0))


def engine_of(request: Request, name: str) -> str:
    """The engine serving `name` as the backend choice says ("llama.cpp", or "tensorrt:fp8"...), so
    replies of one engine are never served for another and metrics say which ran."""
    try:
        choice = request.app.state.scheduler.choice_for(name)
    except LlmdError:  # an unknown model: reported where the request needs it
        return "llama.cpp"
    return choice.backend if choice.backend in ("llama.cpp", "none") else f"{choice.backend}:{choice.precision}"


async def start_run(request: Request, model: str | None, req: GenerationRequest, api: str,
                    stream: bool = False, first_wait: float = FIRST_EVENT_WAIT_S) -> Run:
    """The request submitted and its first event awaited (errors raised as 4xx/5xx); for a `stream`,
    awaited at most `first_wait`, after which the Run yields keep-alives until it comes."""
    _note_loosened(request, req)
    cls, why = classify(request.headers, req, stream, getattr(request.state, "priority_asked", ""))
    req = replace(req, priority=cls)
    try:
        run = await _start(request, model, req, first_wait if stream else None)
    except LlmdError as e:
        outcome = "rejected" if e.status < 500 else "error"
        metrics = request.app.state.metrics
        name = model or request.app.state.scheduler.active_model
        known = metrics.is_model(name)
        metrics.requests.labels(name if known else "(unregistered)", engine_of(request, name) if known else "-",
                                api, outcome).inc()
        raise
    run.api = api
    run.priority_reason = why
    run.metrics = request.app.state.metrics
    if run.dropped:  # never silent: a header, this line, and a counter in status and metrics
        _log.warning("request %s: left out the %d oldest messages of %d so the chat fits %s's context "
                     "(as Ollama does; X-LLMD-Dropped-Messages)", req.id, run.dropped, len(req.messages or ()),
                     run.model)
    run.backend = engine_of(request, run.model).split(":")[0]
    return run


_told_no_thinking: set[str] = set()


def note_no_thinking(request: Request, model: str, asked: list[str]) -> None:
    """Reasoning asked for (`think`, `thinking`, `output_config.effort`) of a model whose template
    writes none: answered without it, the fields named in X-LLMD-Ignored, and logged once per model."""
    if not asked:
        return
    request.state.ignored = [*getattr(request.state, "ignored", []), *asked]
    if model not in _told_no_thinking:
        _told_no_thinking.add(model)
        _log.info("%s: %s asked for, but its chat template writes no reasoning; answering without it",
                  model, " and ".join(asked))


def _note_loosened(request: Request, req: GenerationRequest) -> None:
    """Bounds in the tools' or the reply format's schemas that the grammar drops (chat.schema:
    larger than any reply), named in X-LLMD-Ignored and logged once per request."""
    dropped = [f"tools[{i}].{path}" for i, t in enumerate(req.tools or ())
               for path in loosen(t["function"].get("parameters") or {}, "parameters")[1]]
    fmt = req.response_format or {}
    schema = fmt.get("schema") or (fmt.get("json_schema") or {}).get("schema")
    if isinstance(schema, dict):
        dropped += loosen(schema, "response_format")[1]
    if dropped:
        _log.info("request %s: schema bounds over %d dropped (no bound at all in practice): %s", req.id, MAX_BOUND,
                  ", ".join(dropped))
        shown = [printable(d, 80) for d in dropped]  # a header's text
        request.state.ignored = [*getattr(request.state, "ignored", []), *shown][:16]


async def _start(request: Request, model: str | None, req: GenerationRequest, wait: float | None) -> Run:
    scheduler = request.app.state.scheduler
    admission = admission_of(request.scope, scheduler)  # the batching hint (scheduler.Admission)
    run = None
    try:
        run = await _prepare_run(request, model, req, admission, wait)
        return run
    finally:
        if run is None or run.pending is None:  # else the request is on its way to submission, which takes it out
            admission.leave(scheduler)


async def _prepare_run(request: Request, model: str | None, req: GenerationRequest,
                       admission: Admission, wait: float | None) -> Run:
    """Answer from the response cache, or submit and wait for the first event, so that errors
    become a 4xx/5xx before any body is sent."""
    state = request.app.state
    scheduler = state.scheduler
    name = canonical_name(state.registry, model or scheduler.active_model)
    if not req.speculation:
        req = replace(req, speculation=scheduler.speculation)
    t_start = time.perf_counter()
    client = client_of(request)
    if req.fim is not None and req.cache_prompt and (rest := await state.suggestions.answer(name, req, client)) is not None:
        # the person typed the start of the last proposal: the rest of it is the answer, no model step
        events = _replay(req, Cached([rest], "stop", Usage(0, 0, 0, 0.0, 0.0, 0.0), ()))
        return Run(req, name, events, await events.__anext__(), t_start, cache="hit", request=request)
    if req.fim is not None and req.cache_prompt and await request.is_disconnected():
        # a later keystroke's request came while this one waited for a proposal: it asks for nothing
        raise ClientGone("the client closed the connection before its completion was started")
    cache = state.response_cache
    key = None
    status = "bypass"
    no_store = "no-store" in request.headers.get("cache-control", "").lower()
    keyed = cache is not None and not no_store and cacheable(req)
    if keyed and (served := _served(request, name)) is not None:
        key = cache_key(req, state.registry.get(name), engine_of(request, name), served)
        hit = await asyncio.to_thread(cache.get, key)  # SQLite off the event loop
        if hit is not None:
            events = _replay(req, hit)
            return Run(req, name, events, await events.__anext__(), t_start, cache="hit", request=request)
    if keyed:  # a model not loaded yet: its reply is keyed once the load says how it is served
        status = "miss"
        if key is None:
            cache.misses += 1
    elif cache is not None:
        cache.bypasses += 1
    text: list[str] = []
    proposal = state.suggestions.begin(name, req, text) if req.fim is not None and req.cache_prompt else None
    if proposal is not None and wait is None and req.max_tokens:  # decoded on past the reply, for the next keystrokes
        req = replace(req, propose_tokens=min(req.max_tokens, PROPOSE_TOKENS),
                      reply_within_s=state.suggestions.reply_within(name, client))
    events = scheduler.generate(name, req, admission)
    coming: asyncio.Future[Event] = asyncio.ensure_future(events.__anext__())
    if proposal is not None:  # refused or failed before its first token: nobody waits on it, nor is it kept
        def failed(f: asyncio.Future[Event]) -> None:
            if f.cancelled() or f.exception():
                proposal.finish(False)
                state.suggestions.forget(proposal)
        coming.add_done_callback(failed)
    # a client can hang up while its prompt is still read (an editor at the next keystroke, an agent
    # whose idle timer ran out): noticed at once, whatever the wait, so the engine stops within a step
    gone = asyncio.ensure_future(_disconnected(request))
    watched: set[asyncio.Future[Any]] = {coming, gone}
    try:
        await asyncio.wait(watched, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the client left (the task running the route was cancelled)
        coming.cancel()
        raise
    finally:
        left = gone.done() and not gone.cancelled() and gone.exception() is None
        gone.cancel()
    done = coming.done()
    run = Run(req, name, events, coming.result() if done else None, t_start, admission, cache=status, cache_key=key,
              request=request, pending=None if done else coming, text=text, proposal=proposal)
    if left and not done and proposal is not None:  # dropped: it runs on for the next keystroke
        state.suggestions.dropped(name, client, time.perf_counter() - t_start)
        proposal.run_on(asyncio.ensure_future(run.drain()))
        raise ClientGone("the client closed the connection; its completion is kept for the next keystroke")
    if left and not done:  # its KV computed so far stays in the slot: the same prompt sent again resumes there
        coming.cancel()
        with contextlib.suppress(BaseException):
            await coming
        raise ClientGone("the client closed the connection before the first token")
    after: list[Callable[[Run], Any]] = []
    if proposal is not None:
        after.append(lambda r: _go_on(request, name, r))
    if keyed:
        def store(r: Run) -> Any:
            if r.cache_key is None and (served := _served(request, name)) is not None:
                r.cache_key = cache_key(req, state.registry.get(name), engine_of(request, name), served)
            return asyncio.get_running_loop().run_in_executor(None, _store, cache, r)
        after.append(store)
    if after:
        run.on_done = lambda r: [f(r) for f in after]
    return run


def _go_on(request: Request, name: str, run: Run) -> None:
    """A FIM completion that stopped at its token limit goes on, in the background, from where it
    stopped: a person typing what it proposed reaches its end, and is answered from what follows
    (daemon.suggestions; cancelled as soon as a request it cannot serve comes)."""
    req, state = run.req, request.app.state
    text = "".join(run.text)
    if run.end is None or run.end.finish_reason != "length" or not text or req.fim is None:
        return
    # decoded for nobody until a keystroke asks for it: background work (llmd.priority) till then
    nreq = replace(req, id=uuid.uuid4().hex, fim=replace(req.fim, prefix=req.fim.prefix + text), priority="background")
    pieces: list[str] = []
    proposal = state.suggestions.begin(name, nreq, pieces, after=run.proposal)
    if proposal is None:  # the chain is as long as it may be
        return
    events = state.scheduler.generate(name, nreq)
    more = Run(nreq, name, events, None, time.perf_counter(), pending=asyncio.ensure_future(events.__anext__()),
               text=pieces, proposal=proposal, on_done=lambda r: _go_on(request, name, r))
    # it runs for nobody unless a keystroke asks for it: the deadline of what it goes on from, not a new one
    parent = run.proposal.deadline if run.proposal is not None and run.proposal.task is not None else None
    proposal.run_on(asyncio.ensure_future(more.drain()), deadline=parent)


def _served(request: Request, name: str) -> dict[str, Any] | None:
    """What of the daemon's own setup changes a reply (the response cache's key holds it): the
    batching policy, the llama.cpp build, and the loaded model's context (which bounds a reply and
    decides which old messages are dropped to fit), weight repacking, GPU split and the attention
    kernel as they came out of the load. None while the model is not loaded: those are known only once it is."""
    s = request.app.state.settings
    worker = request.app.state.scheduler.workers.get(name)
    if worker is None or worker.cfg is None:
        return None
    cfg = worker.cfg
    # the attention kernel too: flash attention and matrix products give different logits
    return {"policy": "exact" if s.exact else "fast", "llama_cpp": _llama_cpp_version(), "n_ctx": cfg.n_ctx,
            "repack": cfg.repack, "gpu_layers": worker.info.get("gpu_layers", cfg.gpu_layers),
            "attention": worker.info.get("attention")}


_llama_cpp_version = functools.cache(llama_cpp_version)  # read once: the package cannot change under us


def _store(cache: Any, run: Run) -> None:
    final = run.final
    if final is None or final.finish_reason not in ("stop", "length") or run.cache_key is None:
        return
    if run.admission.fallback:  # another model's reply: not the remote model's to replay
        return
    if run.reply_len is not None and final.usage.completion_tokens < (run.req.max_tokens or 0):
        return  # answered early, cut by time (reply_within_s): not the reply the request asks for
    try:
        cache.put(run.cache_key, run.model, run.text[:run.reply_len] if run.reply_len is not None else run.text,
                  final.finish_reason, final.usage, run.tool_calls)
    except Exception:  # a full disk must not break serving
        import logging

        logging.getLogger("llmd.response_cache").exception("could not store a reply")


_formats: dict[tuple[str, str], ChatFormat] = {}


def _template_of(row: dict[str, Any]) -> str | None:
    from pathlib import Path

    from llmd.models.checkpoint import chat_template
    from llmd.models.gguf import read_gguf

    if row["format"] == "gguf":
        return read_gguf(row["path"]).chat_template
    return chat_template(Path(row["path"]))  # a Hugging Face checkpoint (TensorRT-LLM)


_fims: dict[tuple[str, str], dict[str, str]] = {}


def fim_spellings(row: dict[str, Any]) -> dict[str, str]:
    """The FIM tokens a registered model's vocabulary has, by role (all three: it fills in the
    middle), read once per file (a 150k-token vocabulary takes a quarter of a second)."""
    if row["format"] != "gguf":
        return {}
    key = (row["path"], row["digest"])
    if key not in _fims:
        from llmd.models.gguf import read_gguf

        tokens = read_gguf(row["path"], arrays=("tokenizer.ggml.tokens",)).metadata.get("tokenizer.ggml.tokens")
        _fims[key] = spellings_in_vocab(tokens if isinstance(tokens, list) else None)
    return _fims[key]


async def chat_format(request: Request, model: str) -> ChatFormat:
    """How the model's template writes tool calls and reasoning (what the engine also detects)."""
    row = request.app.state.registry.get(model)
    if row["format"] == "remote":
        return STRUCTURED
    key = (row["path"], row["digest"])
    if key not in _formats:
        _formats[key] = detect(await asyncio.to_thread(_template_of, row))
    return _formats[key]


def normalize_tools(tools: list[Any] | None, where: str = "tools") -> list[dict[str, Any]] | None:
    """Tools in OpenAI's shape ({"type": "function", "function": {...}}), each checked: a name
    of letters, digits, _ . - (at most 64), and parameters that are a JSON schema object."""
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise BadRequest(f"{where}[{i}] is a {kind!r} tool; llmd runs function tools "
                             '({"type": "function", "function": {"name": ..., "parameters": {...}}})', f"{where}[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise BadRequest(f"{where}[{i}].function.name {name!r} must be 1-64 letters, digits, '_', '.' or '-'",
                             f"{where}[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise BadRequest(f"{where}[{i}].function.parameters must be a JSON schema object",
                             f"{where}[{i}].function.parameters")
        clean: dict[str, Any] = {"name": name, "description": fn.get("description") or "",
                 "parameters": params or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": clean})
    names = [t["function"]["name"] for t in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise BadRequest(f"two tools are named {dup!r}; tool names must be unique", where)
    return out


_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
