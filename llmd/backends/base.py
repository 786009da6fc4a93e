"""The engine interface and the plain dataclasses that cross the daemon <-> worker pipe.

Every message is a small frozen dataclass so that the wire format is obvious and versionable.
Prompts travel inside GenerationRequest but are never logged: its repr hides them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

WIRE_VERSION = 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class FimPrompt:
    """Fill in the middle: the code before the cursor, the code after it, and chunks of other files
    (filename, text) that come before both. The engine writes it with the model's own FIM tokens
    (llmd.chat.fim); the texts are never read for special tokens."""

    prefix: str = field(repr=False)
    suffix: str = field(repr=False)
    extra: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # where the completion ends, as an editor shows it (llmd.chat.fim.Cut): at a line indented less
    # than n_indent (the block is over), or after t_max_predict_ms once a line is complete
    n_indent: int = 0
    t_max_predict_ms: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    id: str
    # exactly one of messages (chat), prompt (raw completion) or fim (fill in the middle) is set
    messages: list[dict[str, Any]] | None = field(default=None, repr=False)
    prompt: str | None = field(default=None, repr=False)
    fim: FimPrompt | None = None
    max_tokens: int | None = None  # None: up to the end of the context
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    response_format: dict[str, Any] | None = None  # OpenAI shape; the engine turns it into a grammar
    ctx_limit: int | None = None  # a per-request context bound below the slot's (Ollama num_ctx)
    raw: bool = False  # prompt is already templated (Ollama raw, /v1/completions)
    cache_prompt: bool = True  # reuse a cached prefix (off: compute the whole prompt)
    # fill in the middle: tokens decoded on past the reply's max_tokens, for the editor's next
    # keystrokes (daemon.suggestions); the reply ends at max_tokens (a TokenEvent's reply_end says
    # where) and the client gets only that
    propose_tokens: int = 0
    # fill in the middle, with propose_tokens: the reply ends this long after the engine received
    # the request, with the text shown so far, when the model has not ended it by then (an editor
    # drops its request at the next keystroke: daemon.suggestions learns when); decoding goes on
    reply_within_s: float | None = None
    # "off" | "ngram" (prompt lookup) | "draft" (paired model) | "auto" (cost-aware); "" = the daemon's
    # default (LLMD_SPECULATION, set by the route layer), which an engine left alone treats as auto
    speculation: str = ""
    more_coming: bool = False  # the daemon is preparing other requests that arrived with this one
    # OpenAI-shaped {"type": "function", "function": {name, description, parameters}} (llmd.chat.tools)
    tools: list[dict[str, Any]] | None = field(default=None, repr=False)
    tool_choice: str = "auto"  # "auto" | "none" | "required" | a tool's name
    parallel_tool_calls: bool = True
    top_logprobs: int | None = None  # None: no logprobs; n: each token's logprob and the n most likely
    # Ollama's API: a chat that does not fit the context loses its oldest messages (system messages and
    # the newest kept), as Ollama does, instead of a 400; the first event says how many were left out
    drop_old_messages: bool = False
    # the scheduler could not grow the model's context for this prompt (ContextGrow): fit it as it is
    no_grow: bool = False
    # llmd.priority's class: which requests the engine serves first (how it is scheduled, not its reply)
    priority: str = "interactive"


def reply_fields(req: GenerationRequest) -> dict[str, Any]:
    """Every field of a request that can change its reply, and nothing that cannot (the id,
    cache_prompt, how it is scheduled): the one rule the response cache's key and the autocomplete
    proposals' key are both made from."""
    what: dict[str, Any] = {
        "messages": req.messages,
        "prompt": req.prompt,
        "raw": req.raw,
        "max_tokens": req.max_tokens,
        "sampling": dataclasses.asdict(req.sampling),
        "stop": list(req.stop),
        "response_format": req.response_format,
        "ctx_limit": req.ctx_limit,
        "speculation": req.speculation,  # batched verification can flip a near-tie: keep them apart
    }
    if req.fim is not None:  # absent otherwise, as tools are, so replies stored before stay found
        what["fim"] = dataclasses.asdict(req.fim)
    if req.tools or req.tool_choice != "auto":
        what.update(tools=req.tools, tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls)
    return what


@dataclass(frozen=True)
class EmbedRequest:
    """Embed each input (text, or token ids as OpenAI allows) with the model's pooling."""

    id: str
    inputs: tuple[str | tuple[int, ...], ...] = field(repr=False)
    truncate: bool = False  # cut inputs longer than the context (else the request is refused)
    priority: str = "background"  # llmd.priority's class: an indexer's batch, unless the client asks


@dataclass(frozen=True)
class EmbedResult:
    id: str
    vectors: tuple[bytes, ...]  # float32, unit length, one per input
    tokens: tuple[int, ...]  # tokens read per input
    dim: int


# one sampled token: (its text, its logprob, [(text, logprob) of the most likely tokens])
TokenLogprob = tuple[str, float, tuple[tuple[str, float], ...]]
# a tool call an engine parsed itself (a remote upstream): (its id, the tool's name, the arguments as JSON text)
StructuredCall = tuple[str, str, str]


@dataclass(frozen=True)
class TokenEvent:
    id: str
    text: str
    n_tokens: int  # tokens this piece of text came from (0 when held back text is released)
    logprobs: tuple[TokenLogprob, ...] = ()  # when asked for: the tokens sampled since the last event
    # calls that arrive structured rather than as text to parse (remote upstreams; the routes'
    # parser hands them out with the reply's end); local engines write calls as text
    tool_calls: tuple[StructuredCall, ...] = ()
    dropped_messages: int = 0  # on a request's first event: old messages left out to fit (drop_old_messages)
    reply_end: Usage | None = None  # the reply ends here (its usage); what follows is decoded on (propose_tokens)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float  # request received by the engine -> first token sampled
    prefill_s: float
    decode_s: float
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    queue_s: float = 0.0  # received by the engine -> admitted into a slot
    dropped_messages: int = 0  # old messages left out to fit the context (GenerationRequest.drop_old_messages)

    @property
    def decode_tps(self) -> float:
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 and self.completion_tokens > 1 else 0.0


@dataclass(frozen=True)
class FinalEvent:
    id: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: Usage


@dataclass(frozen=True)
class ErrorEvent:
    id: str
    error: tuple[str, str, str | None]  # errors.LlmdError.to_wire()


Event = TokenEvent | FinalEvent | ErrorEvent | EmbedResult


# daemon -> worker commands
@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Reprioritize:
    """A request's class changes (llmd.priority): an editor's dropped completion runs on for nobody
    as background work, and is interactive again when a keystroke asks for it."""

    id: str
    priority: str


@dataclass(frozen=True)
class StatsRequest:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Loaded:
    """worker -> daemon, once, when the model is ready (or failed: error set)."""

    info: dict[str, Any]
    error: tuple[str, str, str | None] | None = None


@dataclass(frozen=True)
class Stats:
    info: dict[str, Any]


@dataclass(frozen=True)
class ClearCaches:
    """daemon -> worker: drop the engine's own caches (llama.cpp: its prefix cache in memory and its
    entries on disk). The engine removes its files itself, so none is removed under a read."""


@dataclass(frozen=True)
class Cleared:
    """worker -> daemon: what ClearCaches dropped, and the prefix-cache namespace it owns."""
    info: dict[str, Any]


@dataclass(frozen=True)
class Grow:
    """daemon -> worker: a larger context per slot, the weights kept (llama.cpp: growth.py), sent
    when the model has no request open."""
    n_ctx: int


@dataclass(frozen=True)
class Grown:
    """worker -> daemon: the engine's info after Grow, or {"error": why} when it did not grow."""
    info: dict[str, Any]


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model_name: str
    n_ctx: int  # per slot
    n_slots: int
    chunk: int
    threads: int = 0  # llama.cpp: 0 chooses while running, up to the physical cores; n keeps n
    gpu_layers: int = 0
    model_digest: str = ""
    prefix_dir: str = ""  # on-disk prefix KV cache folder; "" turns it off
    prefix_key_file: str = ""  # the HMAC key its entries are signed with (none: the disk tier is off)
    prefix_max_bytes: int = 0
    prefix_min_tokens: int = 256
    profile: bool = False
    precision: str = ""  # TensorRT: fp8 | int8 | int8-weight-only
    draft_path: str = ""  # a paired draft model (same vocabulary) for speculation; "" = none
    speculation: str = "auto"  # the daemon's default (TensorRT-LLM fixes it at load; llama.cpp per request)
    repack: bool = True  # llama.cpp weight repacking (extra buffer types); off where it crashed
    flash_attn: str = "auto"  # llama.cpp's flash-attention kernel: auto | on | off (context.flash_attention)
    exact: bool = False  # the exact batching policy (LLMD_EXACT); else the fast one
    prefill_budget: int = 128  # prompt tokens per step while other streams decode (fast policy)
    ctx_ceiling: int = 0  # what n_ctx may grow to when a prompt needs it (memory.starting_ctx; 0: fixed)
    min_share: float = 0.0  # of the CPU while another model's more urgent work runs (cpu_board.Turns)
    prefix_ram_bytes: int = 0  # in-memory tier of the prefix cache (recently evicted sequences)


@runtime_checkable
class Engine(Protocol):
    """What a backend implements: exactly what `worker_main` and the scheduler use. The worker owns
    one, drives `step` in its loop, sends `info()` once loaded, times the pipe with `profiler` and
    sets `interrupt` (a command is waiting: idle work may stop). A class may also offer a
    `preload()` classmethod that a standby worker calls before it has a model."""

    name: str
    supports_speculation: bool
    supports_prefix_cache: bool
    precisions: tuple[str, ...]
    profiler: Any  # backends.profile.Profiler
    interrupt: Any  # Callable[[], bool] | None

    def info(self) -> dict[str, Any]: ...

    def submit(self, request: GenerationRequest) -> None: ...

    def embed(self, request: EmbedRequest) -> EmbedResult: ...

    def cancel(self, request_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[Event]: ...

    def stats(self) -> dict[str, Any]: ...

    def clear_caches(self) -> dict[str, Any]:
        """Drop the engine's caches; {"prefixes_cleared": n, "namespace": its prefix namespace or ""}."""

    def close(self) -> None: ...


class Handle(Protocol):
    """What the daemon holds for a loaded model and all it uses of it: a local worker process
    (backends/worker.WorkerHandle, which drives an Engine) or a relay to remote upstreams
    (backends/remote/handle.RemoteHandle). The scheduler and the routes see only this."""

    backend: str  # "llama.cpp", "tensorrt" or "remote"
    remote: bool  # True: no local process and no memory here (not counted against LLMD_MAX_LOADED)
    fallback: str | None  # a remote model's local stand-in when every upstream is down
    info: dict[str, Any]  # the engine's info once loaded (status, /api/ps, the routes' chat format)
    started: float  # time.time() at start
    alive: bool

    @property
    def cfg(self) -> EngineConfig | None: ...

    @property
    def hung_for(self) -> float | None:
        """Seconds it sent nothing before the daemon stopped it; None while it has not been."""

    @property
    def pid(self) -> int | None: ...

    @property
    def label(self) -> str: ...

    @property
    def open_requests(self) -> int: ...

    def silent_for(self) -> float: ...

    def kill_hung(self, silent: float) -> None: ...

    async def wait_loaded(self) -> dict[str, Any]: ...

    def submit(self, req: GenerationRequest | EmbedRequest) -> asyncio.Queue[Event]: ...

    def cancel(self, request_id: str) -> None: ...

    def reprioritize(self, request_id: str, priority: str) -> None: ...

    def forget(self, request_id: str) -> None: ...

    async def stats(self, timeout: float = 2.0) -> dict[str, Any]: ...

    async def clear_caches(self, timeout: float = 60.0) -> dict[str, Any]: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...
