"""The daemon side of a remote model: what WorkerHandle is for a local worker (submit, cancel,
stats, shutdown), speaking HTTP to upstream engines instead of a pipe to a process.

A request goes to the least loaded upstream that is up. One that cannot be reached before it
answered anything is marked down and the next is tried; one that fails mid-reply ends that reply
with an error naming it (tokens already sent cannot be taken back). Streams are passed through as
they arrive; cancelling a request closes its upstream connection, which frees the upstream's slot.
Upstream errors become llmd's errors (so each API answers in its own shape) with the upstream
named. Tools go to the upstream as OpenAI's fields, and the calls it parsed come back structured
(TokenEvent.tool_calls), never re-parsed from text; its reasoning is relayed as a <think> block and
its logprobs as llmd's, so every API of llmd answers for a remote model as for a local one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import numpy as np

from llmd.backends.base import (
    EmbedRequest,
    EmbedResult,
    EngineConfig,
    ErrorEvent,
    Event,
    FinalEvent,
    GenerationRequest,
    TokenEvent,
    Usage,
)
from llmd.backends.remote.reply import DONE, Reply, error_of, event_of, request_body, unit_vectors
from llmd.backends.remote.spec import RemoteSpec
from llmd.backends.remote.upstream import HEALTH_S, Upstream, read_key
from llmd.errors import LlmdError, ModelUnavailable, UpstreamError

log = logging.getLogger("llmd.remote")
CONNECT_S = 5.0
QUEUE_EVENTS = 256  # events relayed ahead of the client at most


DRAIN_S = 2.0  # what is left of a body after [DONE] is read for this long at most


async def _drain(lines: Any) -> None:
    async for _ in lines:
        pass


async def _lines(content: aiohttp.StreamReader, wait_s: Callable[[], float]) -> AsyncIterator[str]:
    """The body's lines as they arrive, however long (aiohttp's own line reader has a limit); a
    TimeoutError when nothing arrives for wait_s() seconds (asked again at each read)."""
    buf = b""
    while chunk := await asyncio.wait_for(content.readany(), wait_s()):
        buf += chunk
        *whole, buf = buf.split(b"\n")
        for line in whole:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if buf:
        yield buf.decode("utf-8", "replace")


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class _Unreachable(Exception):
    """The upstream could not be reached before it answered anything: try the next one."""


class RemoteHandle:
    """A remote model (a backends.base.Handle): requests relayed to its upstreams, no process here."""

    backend = "remote"
    remote = True
    pid = None
    hung_for = None  # no process to hang: each request has its own timeouts

    def __init__(self, spec: RemoteSpec, cfg: EngineConfig, loop: asyncio.AbstractEventLoop,
                 read_s: float = 120.0, first_token_s: float = 600.0) -> None:
        self.spec = spec
        self.fallback = spec.fallback  # the local model the scheduler turns to when every upstream is down
        self.cfg = cfg
        self.loop = loop
        self.upstreams = [Upstream(u) for u in spec.urls]
        # aiohttp rather than httpx here: measured on a stand-in upstream, half the time to the first
        # line and less than half the CPU per request (the relay's whole cost is this client)
        # trust_env: HTTPS_PROXY / NO_PROXY apply, as they did with httpx
        # two read timeouts (_generate): until the reply starts, first_token_s (a long prefill or a
        # queue on a healthy upstream); then read_s between chunks (an upstream that stalls mid-reply
        # is cut off and marked down)
        self.read_s = read_s
        self.first_token_s = first_token_s
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S),
                                            trust_env=True)
        self.alive = True
        self.started = time.time()
        self.info: dict[str, Any] = {"engine": "remote", "model": cfg.model_name, "kind": spec.kind,
                                     "upstream_model": spec.upstream_model, "n_ctx": cfg.n_ctx, "load_s": 0.0}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._health: asyncio.Task[None] | None = None

    # ---- the Handle contract (backends/base.py) ---------------------------------------------------

    @property
    def label(self) -> str:
        return self.cfg.model_name

    @property
    def open_requests(self) -> int:
        return len(self._tasks)

    def silent_for(self) -> float:
        return 0.0  # no process to hang: each request has its own timeouts

    def kill_hung(self, silent: float) -> None:
        return None

    async def start(self) -> RemoteHandle:
        """Check every upstream once (none up is not fatal: the fallback may serve), then keep checking."""
        await self._check_all()
        up = [u.url for u in self.upstreams if u.up]
        log.info("remote model %s: %d of %d upstreams up (%s)", self.cfg.model_name, len(up), len(self.upstreams),
                 ", ".join(up) or "none")
        self._health = asyncio.ensure_future(self._health_loop())
        return self

    async def wait_loaded(self) -> dict[str, Any]:
        return self.info

    def any_up(self) -> bool:
        return any(u.up for u in self.upstreams)

    def submit(self, req: GenerationRequest | EmbedRequest) -> asyncio.Queue[Event]:
        # bounded: when the client reads slower than the upstream writes, the relay stops reading the
        # upstream (TCP pushes back to it) instead of buffering the reply here
        queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=QUEUE_EVENTS)
        self._tasks[req.id] = asyncio.ensure_future(self._run(req, queue))
        return queue

    def cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()  # closes the upstream connection: the upstream stops and frees its slot

    def reprioritize(self, request_id: str, priority: str) -> None:
        pass  # an upstream server orders its own work

    def forget(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)

    async def stats(self, timeout: float = 2.0) -> dict[str, Any]:
        return {"slots_busy": sum(u.in_flight for u in self.upstreams), "waiting": 0, "kind": self.spec.kind,
                "upstream_model": self.spec.upstream_model, "upstreams": [u.as_dict() for u in self.upstreams],
                "fallback": self.spec.fallback}

    async def clear_caches(self, timeout: float = 60.0) -> dict[str, Any]:
        return {"prefixes_cleared": 0, "namespace": ""}  # nothing of it is kept here

    def shutdown(self, timeout: float = 30.0) -> None:
        """Called from a thread (as a worker's is): the closing runs on the event loop."""
        self.alive = False
        try:
            asyncio.run_coroutine_threadsafe(self.aclose(), self.loop).result(timeout)
        except Exception:  # the loop is gone: nothing left to close
            pass

    async def aclose(self) -> None:
        self.alive = False
        if self._health is not None:
            self._health.cancel()
        for task in list(self._tasks.values()):
            task.cancel()
        await self.client.close()

    # ---- requests -------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        key = read_key(self.spec.api_key_env, self.spec.api_key_file)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _order(self) -> list[Upstream]:
        """Up ones, least loaded first, in the order given on a tie; down ones are not tried."""
        return sorted((u for u in self.upstreams if u.up), key=lambda u: u.in_flight)

    async def _run(self, req: GenerationRequest | EmbedRequest, queue: asyncio.Queue[Event]) -> None:
        try:
            for up in self._order():
                try:
                    if isinstance(req, EmbedRequest):
                        await self._embed(up, req, queue)
                    else:
                        await self._generate(up, req, queue)
                    up.served += 1
                    return
                except _Unreachable as e:
                    up.mark_down(str(e))
                    log.warning("remote model %s: upstream %s unreachable (%s); trying the next", self.cfg.model_name,
                                up.url, e)
            # every upstream is down now, each with its reason (those just tried included)
            down = "; ".join(f"{u.url} ({u.last_error or 'failed its health check'})" for u in self.upstreams)
            await queue.put(ErrorEvent(req.id, ModelUnavailable(
                f"no upstream of {self.cfg.model_name} is up: {down}; retry when one is back, or add the model with "
                "--fallback LOCAL_MODEL to answer locally meanwhile").to_wire()))
        except LlmdError as e:
            await queue.put(ErrorEvent(req.id, e.to_wire()))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: fail this request, keep serving
            log.exception("remote model %s: request %s failed", self.cfg.model_name, req.id)
            await queue.put(ErrorEvent(req.id, UpstreamError(f"relaying to the upstream failed: {e}").to_wire()))
        finally:
            self._tasks.pop(req.id, None)

    async def _generate(self, up: Upstream, req: GenerationRequest, queue: asyncio.Queue[Event]) -> None:
        chat = req.messages is not None
        url = up.url + ("/v1/chat/completions" if chat else "/v1/completions")
        t0 = time.perf_counter()
        t_first = t_last = 0.0
        n = 0
        finish: str | None = None
        usage: dict[str, Any] = {}
        reply = Reply(up.url, chat)
        up.in_flight += 1
        try:
            try:
                r = await asyncio.wait_for(self.client.post(url, json=request_body(req, self.spec),
                                                            headers=self._headers()), self.first_token_s)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                raise _Unreachable(_why(e)) from e  # nothing was sent: the next may serve it
            except TimeoutError:
                raise self._not_started(up) from None
            try:
                if r.status != 200:
                    raise error_of(self.spec, up.url, r.status, (await r.read())[:4000])
                lines = _lines(r.content, lambda: self.read_s if t_first else self.first_token_s)
                async for line in lines:
                    chunk = event_of(line, up.url)
                    if chunk is None:
                        continue
                    if chunk is DONE:
                        # read to the end of the body (its last chunk follows), so the connection
                        # goes back to the pool instead of being closed: no new connect per request
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(_drain(lines), DRAIN_S)
                        break
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        pieces = reply.add(choice)
                        if pieces:
                            now = time.perf_counter()
                            t_first = t_first or now
                            t_last = now
                        for text, logprobs in pieces:
                            n += 1
                            await queue.put(TokenEvent(req.id, text, 1, logprobs))
                        finish = choice.get("finish_reason") or finish
            except BaseException:
                r.close()  # a cancelled or failed request: the connection closes and the upstream stops
                raise
            r.release()  # read to its end: the connection goes back to the pool
        except TimeoutError:
            if not t_first:  # a slow prefill or a queue: this request gives up, the upstream is not suspect
                raise self._not_started(up) from None
            why = f"it sent nothing for {self.read_s:g} s (LLMD_REMOTE_READ_S)"
            up.mark_down(why)
            raise UpstreamError(f"the upstream {up.url} failed during the reply ({why}); {n} tokens had arrived") from None
        except aiohttp.ClientError as e:  # after it answered: the reply is cut, and the upstream suspect
            why = _why(e)
            up.mark_down(why)
            raise UpstreamError(f"the upstream {up.url} failed during the reply ({why}); "
                                f"{n} tokens had arrived") from e
        finally:
            up.in_flight -= 1
        if finish is None:
            raise UpstreamError(f"the upstream {up.url} ended its event stream without finishing the reply "
                                f"({n} tokens arrived)")
        end, calls = reply.end(cut=finish == "length")
        if end or calls:
            await queue.put(TokenEvent(req.id, end, 0, tool_calls=calls))
        cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) if usage else 0
        await queue.put(FinalEvent(req.id, "length" if finish == "length" else "stop", Usage(
            prompt_tokens=int(usage.get("prompt_tokens") or 0), completion_tokens=int(usage.get("completion_tokens") or n),
            cached_tokens=int(cached), ttft_s=(t_first - t0) if t_first else 0.0,
            prefill_s=(t_first - t0) if t_first else 0.0, decode_s=(t_last - t_first) if t_first else 0.0)))

    def _not_started(self, up: Upstream) -> UpstreamError:
        return UpstreamError(f"the upstream {up.url} had not started its reply after {self.first_token_s:g} s "
                             "(LLMD_REMOTE_FIRST_TOKEN_S): a long prompt or a queue there; retry, or raise the setting")

    async def _embed(self, up: Upstream, req: EmbedRequest, queue: asyncio.Queue[Event]) -> None:
        inputs = [list(i) if isinstance(i, tuple) else i for i in req.inputs]
        try:
            async with self.client.post(up.url + "/v1/embeddings", headers=self._headers(),
                                        json={"model": self.spec.upstream_model, "input": inputs}) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise _Unreachable(_why(e)) from e
        except aiohttp.ClientError as e:
            raise UpstreamError(f"the upstream {up.url} failed: {_why(e)}") from e
        if status != 200:
            raise error_of(self.spec, up.url, status, raw[:4000])
        unit = unit_vectors(raw, up.url)
        await queue.put(EmbedResult(req.id, tuple(v.astype(np.float32).tobytes() for v in unit),
                                     tuple(0 for _ in unit), int(unit[0].shape[0]) if unit else 0))

    async def _check_all(self) -> None:
        try:
            headers = self._headers()
        except LlmdError as e:
            for u in self.upstreams:
                u.mark_down(e.message)
            return
        await asyncio.gather(*(u.check(self.client, headers) for u in self.upstreams))

    async def _health_loop(self) -> None:
        while self.alive:
            await asyncio.sleep(HEALTH_S)
            was = {u.url: u.up for u in self.upstreams}
            await self._check_all()
            for u in self.upstreams:
                if u.up != was[u.url]:
                    log.warning("remote model %s: upstream %s is %s%s", self.cfg.model_name, u.url,
                                "up again" if u.up else "down", "" if u.up else f" ({u.last_error})")
