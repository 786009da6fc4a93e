"""The completion proposed at each cursor, so that typing what it proposed costs no model step.

An editor asks for a completion at every pause and drops the request at the next keystroke. When
the person then types the first characters of what was proposed, the next request's prefix is the
last one plus those characters, and the rest of the proposal is already the model's answer for it
(editors' own suggestion caches do this; here it works for every editor and every route: /infill,
Ollama's suffix, OpenAI's suffix).

On two CPU cores a completion takes longer than a typing pause, so a proposal whose editor dropped
it runs on for a few seconds (ORPHAN_S) instead of being thrown away, and the next keystroke's
request joins it while it is still being decoded: it waits for the proposal when what was typed
agrees with it so far, and is answered from it. A request that the proposal cannot serve (the
person typed something else, another file, another cursor) cancels every dropped proposal of that
model at once, so that what runs for nobody never delays what someone waits for. A proposal that
stopped at its token limit is decoded on from where it stopped (routes._common._go_on), so that a
person who types all of it is still ahead of the model.

An answer is worth something only before the next keystroke, and the server sees when that comes:
an editor drops its request then. So the store keeps how long the last dropped requests of each
model lived, per client (its User-Agent: one editor's typing says nothing of another client's
patience, and a client that never hangs up is never cut), and that client's completions are
answered with what they hold a little before that (REPLY_SHARE of the median), while decoding goes
on as the proposal for the keystrokes that follow.

Kept per model and per text around the cursor (suffix and other files' chunks), in memory, bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmd.backends.base import GenerationRequest, reply_fields
from llmd.chat.fim import typed_since

MAX_ENTRIES = 64
MAX_BYTES = 32 << 20  # the prefixes the store holds, together (an 8 MB prefix is a valid request)
MAX_CHAIN = 3  # proposals kept per cursor: the last one and those it goes on from
MAX_LINKS = 4  # a proposal is decoded on at most this many times from where it stopped
ORPHAN_S = 3.0  # a dropped proposal runs on this long after the last request that wanted it
JOIN_WAIT_S = 60.0  # a proposal that says nothing for this long is not waited for any more (a safety net)
DROPS_KEPT = 16  # how long the last dropped requests of a model lived
MIN_DROPS = 4  # seen before answering early
REPLY_SHARE = 0.8  # answer at this share of their median life (time for the reply to reach the editor)


@dataclass(eq=False)
class Proposal:
    """One completion at one cursor, being decoded or done."""

    model: str
    prefix: str
    request_id: str = ""  # of the run that decodes it
    pieces: list[str] = field(default_factory=list)  # the text so far: the request's own list, filled as it decodes
    follows: bool = False  # decoded on from where the previous proposal at this cursor stopped
    link: int = 0  # how many times what it goes on from was decoded on
    done: bool = False
    complete: bool = False  # ended by the model or the request's limits (not cancelled, not failed)
    task: asyncio.Future[None] | None = None  # its run, draining on after its client left
    deadline: float = 0.0  # loop time: a dropped proposal nobody asked for since is cancelled then
    stats: dict[str, int] = field(default_factory=dict)  # the store's counters (Suggestions.stats)
    _change: asyncio.Event = field(default_factory=asyncio.Event)
    # (model, request id, class): how a proposal running for nobody becomes background work, and
    # interactive again when a keystroke asks for it (the scheduler's reprioritize; None in tests)
    on_priority: Callable[[str, str, str], None] | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def orphan(self) -> bool:
        return self.task is not None and not self.done

    def changed(self) -> None:
        """More text, or the end: whoever waits on it looks again."""
        self._change.set()
        self._change = asyncio.Event()

    def finish(self, complete: bool) -> None:
        if not self.done:
            self.done, self.complete = True, complete
            self.changed()

    def next_change(self) -> asyncio.Future[bool]:
        """A future set at the next change. The event is taken now, not when a task first runs the
        wait: a change between the two (wait_for wraps it in a task on Python 3.10 and 3.11) would
        otherwise be missed, and a finished proposal's waiter slept JOIN_WAIT_S."""
        return asyncio.ensure_future(self._change.wait())

    def run_on(self, task: asyncio.Future[None], deadline: float | None = None) -> None:
        """Its client left: the run goes on in `task` for the next keystroke, for ORPHAN_S; a
        continuation keeps the `deadline` of what it goes on from (only a request that wants it,
        `answer`, extends it), so a chain never keeps itself alive."""
        self.task = task
        self._count("ran_on")
        self._set_priority("background")  # decoded for nobody now: after what someone waits for
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its error is its own: nobody waits
        loop = asyncio.get_running_loop()
        self.deadline = deadline if deadline is not None else loop.time() + ORPHAN_S
        loop.call_later(max(0.0, self.deadline - loop.time()), self._expire)

    def wanted(self) -> None:
        """A keystroke's request waits on it: it runs on, for someone again."""
        self.deadline = asyncio.get_running_loop().time() + ORPHAN_S
        if not self.done:
            self._set_priority("interactive")

    def _set_priority(self, cls: str) -> None:
        if self.on_priority is not None and self.request_id:
            self.on_priority(self.model, self.request_id, cls)

    def cancel(self, why: str = "cancelled") -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            self._count(why)

    def _count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def _expire(self) -> None:
        if self.done:
            return
        left = self.deadline - asyncio.get_running_loop().time()
        if left > 0:
            asyncio.get_running_loop().call_later(left, self._expire)
        else:
            self.cancel("expired")


def _whole_lines(so_far: str, typed: str) -> str | None:
    """What follows `typed` in a proposal still being decoded, to the end of its last complete line, when
    that holds text (an editor shows a completion to the end of a line: that much need not wait
    for the rest)."""
    if not so_far.startswith(typed):
        return None
    rest = so_far[len(typed):]
    end = rest.rfind("\n")
    return rest[:end + 1] if end > 0 and rest[:end].strip() else None


class Suggestions:
    def __init__(self, size: int = MAX_ENTRIES) -> None:
        self._last: OrderedDict[str, list[Proposal]] = OrderedDict()  # key -> the proposals there, oldest first
        self._size = size
        # answered from a proposal; dropped ones that ran on; of those, cancelled for a request they
        # could not serve, and cancelled at ORPHAN_S with nobody asking
        self.stats = {"answered": 0, "ran_on": 0, "cancelled": 0, "expired": 0}
        self._drops: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()
        self.on_priority: Callable[[str, str, str], None] | None = None  # given to each Proposal

    def dropped(self, model: str, client: str, lived_s: float) -> None:
        """`client` (an editor) dropped a completion of `model` after `lived_s`: its next keystroke came."""
        key = (model, client)
        times = self._drops.pop(key) if key in self._drops else deque(maxlen=DROPS_KEPT)
        times.append(lived_s)
        self._drops[key] = times  # most recent last: the oldest client goes first
        while len(self._drops) > self._size:  # bounded however many User-Agents come
            self._drops.popitem(last=False)

    def reply_within(self, model: str, client: str) -> float | None:
        """How soon `client`'s completion of `model` should answer with what it has: a little before
        that client's requests have been dropped (None until a few were)."""
        drops = self._drops.get((model, client), ())
        return REPLY_SHARE * statistics.median(drops) if len(drops) >= MIN_DROPS else None

    def reply_times(self) -> dict[str, dict[str, float]]:
        """reply_within by model and client, rounded (for /llmd/status)."""
        out: dict[str, dict[str, float]] = {}
        for model, client in self._drops:
            if (t := self.reply_within(model, client)) is not None:
                out.setdefault(model, {})[client] = round(t, 3)
        return out

    @staticmethod
    def _key(model: str, req: GenerationRequest) -> str | None:
        """One cursor's key: every field that changes a reply (`reply_fields`, the response
        cache's rule) but the typing itself and the seed; None when a proposal cannot answer it
        (it holds no log probabilities)."""
        if req.fim is None or req.top_logprobs is not None:
            return None
        what = reply_fields(req)
        what["fim"] = {k: v for k, v in what["fim"].items() if k != "prefix"}
        what["sampling"] = {**what["sampling"], "seed": None}
        return hashlib.sha256(json.dumps([model, what], ensure_ascii=False, default=str).encode()).hexdigest()

    async def answer(self, model: str, req: GenerationRequest, client: str = "") -> str | None:
        """The rest of a proposal at this cursor when this request's prefix is its prefix plus a
        start of it (waiting for a proposal still being decoded while what was typed agrees with it
        so far); None when the model must be asked, after cancelling the dropped proposals of
        `model` that then serve nobody."""
        key = self._key(model, req)
        if key is None or req.fim is None or (req.max_tokens is not None and req.max_tokens <= 0):
            return None
        loop = asyncio.get_running_loop()
        within = self.reply_within(model, client)
        by = None if within is None else loop.time() + within  # answered with what a proposal holds then
        while (p := self._serving(chain := self._last.get(key, []), req.fim.prefix)) is not None:
            typed = typed_since(p.prefix, req.fim.prefix) or ""
            if p.done:
                self.stats["answered"] += 1
                rest = p.text[len(typed):]
                for q in chain[chain.index(p) + 1:]:
                    if q.orphan:
                        q.wanted()  # what is decoded on from it is wanted too
                    elif q.complete and q.prefix == p.prefix + p.text:
                        rest, p = rest + q.text, q  # and what was, with it
                return rest
            if p.orphan:
                p.wanted()  # someone is still typing into it
            if (lines := _whole_lines(p.text, typed)) is not None:
                self.stats["answered"] += 1  # what an editor shows is here; the rest is still decoded
                return lines
            left = JOIN_WAIT_S if by is None else by - loop.time()
            if left <= 0 and len(p.text) > len(typed):
                self.stats["answered"] += 1  # what it holds, before the editor drops this request
                return p.text[len(typed):]
            late = by is None or left <= 0
            try:  # past `by` (or without one), only the safety net bounds the wait
                await asyncio.wait_for(p.next_change(), JOIN_WAIT_S if late else left)
            except TimeoutError:
                if late:
                    break
        self.drop_orphans(model)
        return None

    @staticmethod
    def _serving(chain: list[Proposal], prefix: str) -> Proposal | None:
        """The newest proposal that answers `prefix` (done) or may (still decoded, agreeing so far)."""
        for p in reversed(chain):
            typed = typed_since(p.prefix, prefix)
            if typed is None or (not typed and not p.follows):  # the same request again: ask anew
                continue
            so_far = p.text
            if not (so_far.startswith(typed) or typed.startswith(so_far)):
                continue  # the person typed something else
            if not p.done:
                return p
            if p.complete and len(so_far) > len(typed):
                return p
        return None

    def begin(self, model: str, req: GenerationRequest, pieces: list[str],
              after: Proposal | None = None) -> Proposal | None:
        """A new proposal at this request's cursor, its text the list `pieces` as it is decoded;
        `after`: the proposal it goes on from, where that one stopped (both are kept)."""
        key = self._key(model, req)
        if key is None or req.fim is None or (after is not None and after.link + 1 >= MAX_LINKS):
            return None
        follows = after is not None
        p = Proposal(model, req.fim.prefix, req.id, pieces, follows, link=after.link + 1 if after else 0,
                     stats=self.stats, on_priority=self.on_priority)
        chain = self._last.pop(key, [])
        if not follows:
            for old in chain:
                old.cancel()
            chain = []
        chain.append(p)
        for old in chain[:-MAX_CHAIN]:
            old.cancel()
        self._last[key] = chain[-MAX_CHAIN:]
        while len(self._last) > self._size or (len(self._last) > 1 and self.held_bytes() > MAX_BYTES):
            for old in self._last.popitem(last=False)[1]:
                old.cancel()
        return p

    def held_bytes(self) -> int:
        return sum(len(p.prefix) + len(p.text) for chain in self._last.values() for p in chain)

    def forget(self, p: Proposal) -> None:
        """A proposal whose request failed before its first token (an unknown model, a prompt over
        the context): nothing to answer from, and its prefix is not kept."""
        for key, chain in list(self._last.items()):
            if p in chain:
                chain.remove(p)
                if not chain:
                    del self._last[key]

    def drop_orphans(self, model: str) -> None:
        for chain in self._last.values():
            for p in chain:
                if p.model == model and p.orphan:
                    p.cancel()
