"""The last completion proposed at each cursor, so that typing what it proposed costs no model step.

An editor asks for a completion at every pause. When the person then types the first characters
of what was proposed, the next request's prefix is the last one plus those characters, and the
rest of the proposal is already the model's answer for it (editors' own suggestion caches do
this; here it works for every editor and every route: /infill, Ollama's suffix, OpenAI's suffix).
Kept per model and per text around the cursor (suffix and other files' chunks), in memory,
bounded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict

from llmd.backends.base import GenerationRequest

MAX_ENTRIES = 64


class Suggestions:
    def __init__(self, size: int = MAX_ENTRIES) -> None:
        self._last: OrderedDict[str, tuple[str, str]] = OrderedDict()  # key -> (prefix, proposed text)
        self._size = size
        self._lock = threading.Lock()
        self.hits = 0

    @staticmethod
    def _key(model: str, req: GenerationRequest) -> str | None:
        if req.fim is None:
            return None
        around = {k: v for k, v in dataclasses.asdict(req.fim).items() if k != "prefix"}  # all but the typing
        what = [model, around, req.stop, req.response_format, dataclasses.asdict(req.sampling) | {"seed": None}]
        return hashlib.sha256(json.dumps(what, ensure_ascii=False).encode()).hexdigest()

    def get(self, model: str, req: GenerationRequest) -> str | None:
        """The rest of the last proposal when this request's prefix is the last one plus a start of it."""
        key = self._key(model, req)
        if key is None or req.fim is None:
            return None
        with self._lock:
            last = self._last.get(key)
        if last is None:
            return None
        prefix, text = last
        typed = req.fim.prefix[len(prefix):] if req.fim.prefix.startswith(prefix) else None
        if not typed or not text.startswith(typed) or len(text) == len(typed):
            return None
        rest = text[len(typed):]
        if req.max_tokens is not None and req.max_tokens <= 0:
            return None
        self.hits += 1
        return rest

    def put(self, model: str, req: GenerationRequest, text: str) -> None:
        key = self._key(model, req)
        if key is None or req.fim is None or not text:
            return
        with self._lock:
            self._last[key] = (req.fim.prefix, text)
            self._last.move_to_end(key)
            while len(self._last) > self._size:
                self._last.popitem(last=False)
