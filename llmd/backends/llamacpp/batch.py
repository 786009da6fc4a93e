"""Writing one row of a llama_batch: shared by the target engine and the draft model."""

from __future__ import annotations

from typing import Any


def put(batch: Any, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = logits
