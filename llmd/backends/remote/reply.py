"""What the remote relay says to an upstream and how it reads the answers, as pure functions: the
request body (OpenAI's fields), the event stream's lines, a streamed reply assembled into llmd's
pieces (content, reasoning as a <think> block, logprobs, tool calls from their deltas), embeddings,
and HTTP errors mapped to llmd's. The I/O (connections, upstream choice, the relay loop) is
backends/remote/handle.py.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np

from llmd.backends.base import GenerationRequest, StructuredCall
from llmd.backends.remote.spec import RemoteSpec
from llmd.errors import BadRequest, LlmdError, ModelNotFound, UpstreamError

DONE: dict[str, Any] = {}  # event_of's answer for the stream's "data: [DONE]"


def upstream_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as OpenAI's API takes it: every call has an id and every tool result the id of
    the call it answers. Ollama's clients send neither (a result names its tool): a call without
    an id gets one, and a result the first unanswered call of its tool's name (else of any)."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # calls of the last assistant turn not answered yet
    for turn, m in enumerate(messages):
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [c if c.get("id") else {**c, "id": f"call_{turn}_{k}"} for k, c in enumerate(m["tool_calls"])]
            m = {**m, "tool_calls": calls}
            pending = list(calls)
        elif m.get("role") == "tool":
            match = next((c for c in pending if c["id"] == m.get("tool_call_id")), None)
            if match is None and pending:
                named = [c for c in pending if (c.get("function") or {}).get("name") == m.get("name")]
                match = (named or pending)[0]
                m = {**m, "tool_call_id": match["id"]}
            if match is not None:
                pending.remove(match)
        out.append(m)
    return out


class Reply:
    """One streamed reply as the upstream sends it, turned into llmd's pieces: content, reasoning as
    a <think> block, logprobs, and the tool calls assembled from their deltas (handed out at the end)."""

    def __init__(self, url: str, chat: bool) -> None:
        self.url = url
        self.chat = chat
        self.thinking = False
        self.calls: dict[int, dict[str, str]] = {}

    def add(self, choice: dict[str, Any]) -> list[tuple[str, tuple[Any, ...]]]:
        if not self.chat:
            return [(choice["text"], _completion_logprobs(choice.get("logprobs")))] if choice.get("text") else []
        delta = choice.get("delta") or choice.get("message") or {}
        out: list[tuple[str, tuple[Any, ...]]] = []
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out.append((("" if self.thinking else "<think>") + reasoning, ()))
            self.thinking = True
        content = delta.get("content")
        logprobs = _chat_logprobs(choice.get("logprobs"))
        if (isinstance(content, str) and content) or logprobs:
            out.append((("</think>" if self.thinking else "") + (content or ""), logprobs))
            self.thinking = False
        for c in delta.get("tool_calls") or []:
            index = c.get("index")
            if not isinstance(index, int):  # no index: a new id starts a call, else it goes on the last
                last = max(self.calls, default=-1)
                index = last + 1 if last < 0 or (c.get("id") and c["id"] != self.calls[last]["id"]) else last
            call = self.calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
            fn = c.get("function") or {}
            call["id"] = c.get("id") or call["id"]
            name = fn.get("name") or ""
            if name != call["name"]:  # a name in pieces is joined; one sent again whole is not doubled
                call["name"] += name
            args = fn.get("arguments")
            call["arguments"] += args if isinstance(args, str) else json.dumps(args) if args is not None else ""
        return out

    def end(self, cut: bool) -> tuple[str, tuple[StructuredCall, ...]]:
        """Text still owed (a think block left open) and the calls, each checked. A call cut short by
        max_tokens (`cut`) whose arguments are not whole is passed on as the text it is, as a local
        model's would be: the reply says "length", and nothing is dropped."""
        text = "</think>" if self.thinking else ""
        calls = []
        for index in sorted(self.calls):
            c = self.calls[index]
            args = c["arguments"].strip() or "{}"
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if cut and not isinstance(parsed, dict):
                text += f'{{"name": {json.dumps(c["name"])}, "arguments": {c["arguments"]}'
                continue
            if not c["name"] or not isinstance(parsed, dict):
                raise UpstreamError(f"the upstream {self.url} sent a tool call that llmd cannot pass on (name "
                                    f"{c['name']!r}, arguments {args[:200]!r}: not a JSON object)")
            calls.append((c["id"] or "call_" + uuid.uuid4().hex[:24], c["name"], args))
        return text, tuple(calls)


def _chat_logprobs(lp: Any) -> tuple[Any, ...]:
    if not isinstance(lp, dict) or not lp.get("content"):
        return ()
    return tuple((e["token"], float(e["logprob"]), tuple((t["token"], float(t["logprob"]))
                                                          for t in e.get("top_logprobs") or []))
                 for e in lp["content"])


def _completion_logprobs(lp: Any) -> tuple[Any, ...]:
    if isinstance(lp, dict) and lp.get("content"):  # llama-server answers completions in the chat shape
        return _chat_logprobs(lp)
    if not isinstance(lp, dict) or not lp.get("tokens"):
        return ()
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    return tuple((tok, float(p), tuple((t, float(q)) for t, q in (top or {}).items()))
                 for tok, p, top in zip(lp["tokens"], lp.get("token_logprobs") or [], tops, strict=False))


def request_body(req: GenerationRequest, spec: RemoteSpec) -> dict[str, Any]:
    """The OpenAI-shaped body llmd sends upstream for a request (always streamed, usage included)."""
    s = req.sampling
    body: dict[str, Any] = {"model": spec.upstream_model, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": s.temperature}
    if req.fim is not None:  # an empty prompt would be sent and answered as if it were the code
        raise BadRequest("this model is served by another engine, and llmd does not relay fill-in-the-middle to "
                         "it; use a local FIM model (Qwen2.5-Coder, StarCoder2...) for completions", "suffix")
    if req.messages is not None:
        body["messages"] = upstream_messages(req.messages)
    else:
        body["prompt"] = req.prompt or ""
    if req.tools:
        body["tools"] = req.tools
        body["tool_choice"] = (req.tool_choice if req.tool_choice in ("auto", "none", "required")
                               else {"type": "function", "function": {"name": req.tool_choice}})
        if not req.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    if req.top_logprobs is not None:
        if req.messages is not None:
            body.update(logprobs=True, top_logprobs=req.top_logprobs)
        else:
            body["logprobs"] = req.top_logprobs
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    optional = {"top_p": (s.top_p, 1.0), "top_k": (s.top_k, 0), "min_p": (s.min_p, 0.0),
                "presence_penalty": (s.presence_penalty, 0.0), "frequency_penalty": (s.frequency_penalty, 0.0)}
    body.update({k: v for k, (v, default) in optional.items() if v != default})
    if s.repeat_penalty != 1.0:  # not in OpenAI's API: each engine's own name
        body["repetition_penalty" if spec.kind in ("vllm", "sglang") else "repeat_penalty"] = s.repeat_penalty
    if s.seed is not None:
        body["seed"] = s.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.response_format is not None:
        body["response_format"] = req.response_format
    return body


def event_of(line: str, url: str) -> dict[str, Any] | None:
    """One line of an upstream's event stream: its JSON chunk, DONE at the end, None for what carries
    nothing (blank lines, comments); UpstreamError for a malformed stream or an error event."""
    if not line.strip() or line.startswith(":"):
        return None
    if not line.startswith("data:"):
        raise UpstreamError(f"the upstream {url} sent a malformed event stream ({line[:120]!r}); "
                            "is it an OpenAI-compatible server?")
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        chunk = json.loads(data)
    except ValueError:
        raise UpstreamError(f"the upstream {url} sent an event that is not JSON ({data[:120]!r})") from None
    if not isinstance(chunk, dict):
        raise UpstreamError(f"the upstream {url} sent an event that is not an object ({data[:120]!r})")
    if chunk.get("error"):
        err = chunk["error"]
        raise UpstreamError(f"the upstream {url} failed: {err.get('message') if isinstance(err, dict) else err}")
    return chunk


def unit_vectors(raw: bytes, url: str) -> list[Any]:
    """An upstream's /v1/embeddings answer as unit-length float32 vectors, in input order."""
    try:
        data = sorted(json.loads(raw)["data"], key=lambda d: d["index"])
        vectors = [np.asarray(d["embedding"], dtype=np.float32) for d in data]
    except (ValueError, KeyError, TypeError) as e:
        raise UpstreamError(f"the upstream {url} answered embeddings in an unknown shape: {e}") from e
    return [v / (float(np.linalg.norm(v)) or 1.0) for v in vectors]


def error_of(spec: RemoteSpec, url: str, status: int, raw: bytes) -> LlmdError:
    """An upstream's HTTP error as llmd's own (each API answers it in its shape), the upstream named."""
    try:
        err = json.loads(raw).get("error", raw.decode("utf-8", "replace"))
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = raw.decode("utf-8", "replace")
    message = message.strip()[:500] or f"HTTP {status}"
    where = f"the upstream {url} ({spec.kind})"
    if status in (401, 403):
        src = spec.api_key_env or spec.api_key_file or "no key configured"
        return UpstreamError(f"{where} refused llmd's credentials (HTTP {status}: {message}); check the API key "
                             f"({src})")
    if status == 404:
        return ModelNotFound(f"{where} answered 404 for {spec.upstream_model!r}: {message}", "model")
    if status == 429:
        return UpstreamError(f"{where} is overloaded (HTTP 429: {message}); retry shortly")
    if 400 <= status < 500:
        return BadRequest(f"{where} refused the request (HTTP {status}): {message}")
    return UpstreamError(f"{where} failed (HTTP {status}): {message}")
