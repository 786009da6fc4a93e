"""The prefix cache of one engine: what to keep of a slot's KV beyond the slot, and how to bring
it back. Two tiers: recently evicted sequences in memory, then the disk store (prefix_store.py),
which survives restarts and model switches.

A snapshot is taken when the engine is idle (or at shutdown), never on a request's path: the
slot's state is copied once (`llama_state_seq_get_data`), kept in memory, and handed to the
writer thread for disk. A lookup finds the deepest stored block of a prompt in either tier and,
under the fast policy, extends the match token by token against the entry's own tokens; the
exact policy restores only whole blocks of prefill-computed KV. A disk entry is read and
checked on the reader thread (the lookup answers a Future; the engine keeps stepping the other
slots meanwhile), and before the target slot is touched, so a bad entry never costs the slot its
live KV.
"""

from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmd.backends.llamacpp.prefix_store import (
    PrefixReader,
    PrefixStore,
    PrefixWriter,
    StaleEntry,
    block_hashes,
    namespace,
)
from llmd.backends.llamacpp.slots import Slot, common_prefix

log = logging.getLogger("llmd.prefix_cache")


@dataclass
class Hit:
    source: str  # "memory" | "disk"
    entry: str
    tokens: list[int]
    state: bytes
    n: int  # prompt tokens it serves


class PrefixCache:
    def __init__(self, root: str, max_bytes: int, ram_bytes: int, model_digest: str, chunk: int, exact: bool,
                 min_tokens: int, key: bytes = b"", flash_attn: bool = True) -> None:
        """`key`: the HMAC key entries are signed with; without one the disk tier is off.
        `flash_attn`: without it llama.cpp stores V transposed, so the states differ in layout."""
        self.chunk = chunk
        self.exact = exact
        self.min_tokens = min_tokens
        self.ns = namespace(model_digest, chunk, "exact" if exact else "fast", "f16" if flash_attn else "f16-vt")
        self.disk = PrefixStore(Path(root), max_bytes, key) if root and max_bytes > 0 and key else None
        self.writer = PrefixWriter(Path(root), max_bytes, key) if self.disk is not None else None
        self.reader = PrefixReader(Path(root), max_bytes, key) if self.disk is not None else None
        self.ram_bytes = ram_bytes
        self._ram: OrderedDict[str, tuple[list[int], bytes]] = OrderedDict()  # entry -> (tokens, state), LRU
        self._ram_blocks: dict[str, tuple[str, int]] = {}  # block hash -> (entry, depth)
        self._ram_used = 0
        self.stats = {"hits": 0, "memory_hits": 0, "misses": 0, "tokens_restored": 0, "saved": 0, "dropped": 0,
                      "stale": 0}

    @property
    def enabled(self) -> bool:
        return self.disk is not None or self.ram_bytes > 0

    # ---- lookup and restore -----------------------------------------------------------------------

    def lookup(self, prompt: list[int], live: int) -> Hit | Future[Hit | None] | None:
        """The stored prefix serving the most of `prompt`, when it beats `live` tokens of reuse: a
        Hit from memory, a Future of one for a disk entry (read on the reader thread), or None."""
        n_blocks = (len(prompt) - 1) // self.chunk
        if n_blocks * self.chunk <= live:
            return None
        hashes = block_hashes(self.ns, prompt[: n_blocks * self.chunk], self.chunk)
        hit = self._from_ram(hashes, prompt)
        if hit is not None:
            return hit if hit.n > live else None
        pending = self._from_disk(hashes, prompt, live)
        if pending is None:
            self.stats["misses"] += 1
        return pending

    def _serves(self, tokens: list[int], prompt: list[int], depth: int) -> int:
        if self.exact:
            return depth * self.chunk
        return min(common_prefix(tokens, prompt), len(prompt) - 1)

    def _from_ram(self, hashes: list[str], prompt: list[int]) -> Hit | None:
        best = max((self._ram_blocks[h] for h in hashes if h in self._ram_blocks), key=lambda e: e[1], default=None)
        if best is None:
            return None
        entry, depth = best
        tokens, state = self._ram[entry]
        self._ram.move_to_end(entry)
        return Hit("memory", entry, tokens, state, self._serves(tokens, prompt, depth))

    def _from_disk(self, hashes: list[str], prompt: list[int], live: int) -> Future[Hit | None] | None:
        if self.disk is None or self.reader is None:
            return None
        try:
            match = self.disk.lookup(hashes)
        except Exception as e:  # a damaged index or an I/O error: serve without the disk tier
            self._disk_failed(e)
            return None
        if match is None or match.depth * self.chunk <= live:  # not worth reading the file
            return None
        entry, depth = match.entry, match.depth
        expect = prompt[: depth * self.chunk]

        def read(store: PrefixStore) -> Hit | None:
            try:
                got = store.read(entry, expect, self.ns)
            except StaleEntry:  # another llama.cpp build or model file wrote it: never restored
                self.stats["stale"] += 1
                return None
            except Exception as e:
                log.warning("prefix cache: reading entry %s failed (%s: %s)", entry, type(e).__name__, e)
                got = None
            if got is None:
                self.stats["dropped"] += 1
                return None
            tokens, state = got
            hit = Hit("disk", entry, tokens, state, self._serves(tokens, prompt, depth))
            return hit if hit.n > live else None

        return self.reader.run(read)

    def _disk_failed(self, e: Exception) -> None:
        log.warning("prefix cache: the disk store failed (%s: %s); serving without it until the model reloads "
                    "(a damaged index is rebuilt then)", type(e).__name__, e)
        self.disk = None

    def restore(self, L: Any, ctx: Any, mem: Any, slot: Slot, hit: Hit) -> bool:
        """Load `hit` into `slot` and trim it to the tokens it serves. False (slot emptied, entry
        dropped) when llama.cpp refuses the state."""
        slot.forget(L, mem)
        src = ctypes.cast(ctypes.c_char_p(hit.state), ctypes.POINTER(ctypes.c_uint8))
        loaded = L.llama_state_seq_set_data(ctx, src, len(hit.state), slot.seq)
        # the state must hold exactly the entry's tokens, at positions 0..n-1: a payload for another
        # prompt length (a crafted or mixed-up file whose checksum was fixed up) would answer wrongly
        span = (L.llama_memory_seq_pos_min(mem, slot.seq), L.llama_memory_seq_pos_max(mem, slot.seq))
        if loaded == 0 or span != (0, len(hit.tokens) - 1):
            why = "llama.cpp refused it" if loaded == 0 else (
                f"its state holds positions {span[0]}..{span[1]}, its tokens are {len(hit.tokens)}")
            log.warning("prefix cache: dropping %s entry %s: %s", hit.source, hit.entry, why)
            self._drop(hit)
            slot.forget(L, mem)
            return False
        slot.tokens[:] = hit.tokens
        slot.saved = len(hit.tokens)
        slot.exact = len(hit.tokens) if self.exact else 0
        slot.truncate(L, mem, hit.n)
        self.stats["hits"] += 1
        self.stats["memory_hits"] += hit.source == "memory"
        self.stats["tokens_restored"] += hit.n
        return True

    def _drop(self, hit: Hit) -> None:
        self.stats["dropped"] += 1
        if hit.source == "memory":
            self._forget_ram(hit.entry)
        elif self.disk is not None:
            self.disk.drop(hit.entry)

    # ---- snapshots ----------------------------------------------------------------------------

    def wants(self, slot: Slot) -> bool:
        """Whether the idle slot holds KV worth a snapshot that is not stored yet."""
        n = slot.exact if self.exact else len(slot.tokens)
        return self.enabled and n >= max(self.min_tokens, self.chunk) and n > slot.saved and not slot.shift_pending

    def save(self, L: Any, ctx: Any, mem: Any, slot: Slot) -> None:
        """Snapshot the slot's KV (exact policy: its exact prefix only) into memory and to disk."""
        if slot.shift_pending:  # its keys are rotated at the next decode: a snapshot now would be wrong
            return
        if self.exact:
            slot.truncate(L, mem, slot.exact)  # the partial tail is not exact, so never reused
        tokens = list(slot.tokens)
        slot.saved = len(tokens)
        hashes = block_hashes(self.ns, tokens, self.chunk)
        if not hashes:
            return
        in_ram = hashes[-1] in self._ram_blocks and len(self._ram[self._ram_blocks[hashes[-1]][0]][0]) >= len(tokens)
        try:
            on_disk = self.disk is not None and self.disk.has(hashes[-1])
        except Exception as e:
            self._disk_failed(e)
            on_disk = False
        if in_ram and (on_disk or self.disk is None):
            return
        size = L.llama_state_seq_get_size(ctx, slot.seq)
        buf = (ctypes.c_uint8 * size)()
        got = L.llama_state_seq_get_data(ctx, buf, size, slot.seq)
        if not got:
            return
        state = bytes(memoryview(buf)[:got])
        self._keep_ram(hashes, tokens, state)
        if self.writer is not None and self.disk is not None and not on_disk:
            self.writer.submit(self.ns, tokens, hashes, state)
        self.stats["saved"] += 1

    def _keep_ram(self, hashes: list[str], tokens: list[int], state: bytes) -> None:
        if len(state) > self.ram_bytes:
            return
        entry = hashes[-1][:32]
        self._forget_ram(entry)
        self._ram[entry] = (tokens, state)
        self._ram_used += len(state)
        for depth, h in enumerate(hashes, 1):
            self._ram_blocks[h] = (entry, depth)
        while self._ram_used > self.ram_bytes and self._ram:
            self._forget_ram(next(iter(self._ram)))

    def _forget_ram(self, entry: str) -> None:
        got = self._ram.pop(entry, None)
        if got is None:
            return
        self._ram_used -= len(got[1])
        for h in [h for h, (e, _) in self._ram_blocks.items() if e == entry]:
            del self._ram_blocks[h]

    @property
    def writing(self) -> bool:
        return self.writer is not None and self.writer.busy

    def info(self) -> dict[str, Any]:
        return {**self.stats, "enabled": self.enabled, "memory_entries": len(self._ram),
                "memory_bytes": self._ram_used}

    def clear(self) -> int:
        """Forget every entry of this namespace, in memory and on disk (after the writes in flight,
        in the reader's thread so no read of this worker meets a file going away). Entries."""
        n = len(self._ram)
        self._ram.clear()
        self._ram_blocks.clear()
        self._ram_used = 0
        if self.writer is not None:
            self.writer.discard()
        if self.reader is not None:
            n += self.reader.run(lambda store: store.clear(self.ns)).result()
        return n

    def close(self) -> None:
        """Write every pending snapshot to disk (a graceful shutdown loses none)."""
        if self.reader is not None:
            self.reader.close()
        if self.writer is not None:
            self.writer.close(timeout=60.0)
