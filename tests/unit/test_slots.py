from llmd.backends.llamacpp.slots import Slot


def test_reuse_only_whole_exact_chunks():
    slot = Slot(seq=0, tokens=list(range(200)), exact=128)
    # shares 150 tokens, but only 128 were computed by aligned prefill
    assert slot.reusable(list(range(150)) + [999] * 50, chunk=64) == 128
    # shares 100 tokens: one whole chunk
    assert slot.reusable(list(range(100)) + [999] * 50, chunk=64) == 64
    assert slot.reusable([5] + list(range(1, 300)), chunk=64) == 0


def test_reuse_always_leaves_a_token_to_compute():
    slot = Slot(seq=0, tokens=list(range(128)), exact=128)
    assert slot.reusable(list(range(128)), chunk=64) == 64
    assert slot.reusable(list(range(64)), chunk=64) == 0


class _FakeKV:
    """llama.cpp's per-sequence KV as position -> token, with seq_rm and seq_add (shifts)."""

    def __init__(self, tokens: list[int]) -> None:
        self.cells = dict(enumerate(tokens))

    def llama_memory_seq_rm(self, mem, seq, p0, p1):  # noqa: ANN001, ANN201 - llama.cpp's signature
        p1 = float("inf") if p1 < 0 else p1
        p0 = 0 if p0 < 0 else p0
        self.cells = {p: t for p, t in self.cells.items() if not p0 <= p < p1}

    def llama_memory_seq_add(self, mem, seq, p0, p1, delta):  # noqa: ANN001, ANN201
        moved = {p + delta: t for p, t in self.cells.items() if p0 <= p < p1}
        assert not set(moved) & {p for p in self.cells if not p0 <= p < p1}, "a shift landed on other cells"
        self.cells = {**{p: t for p, t in self.cells.items() if not p0 <= p < p1}, **moved}


def test_reuse_shifted_moves_the_runs_a_slid_window_keeps():
    from llmd.backends.llamacpp.slots import Slot

    old = [1] + list(range(100, 110)) + list(range(200, 300)) + [7, 8] + list(range(400, 480)) + [9]
    new = [1] + list(range(200, 300)) + [5] + list(range(400, 480)) + [9]  # first line gone, one edit
    kv = _FakeKV(old)
    slot = Slot(seq=0, tokens=list(old))
    served = slot.reuse_shifted(kv, None, new, 1, 64)
    assert served == 101  # the common start and the slid run; after the edit, computed again
    assert slot.tokens == new[:served] and kv.cells == dict(enumerate(new[:served]))
    assert slot.shift_pending  # until the next llama_decode: neither copied nor saved (kv_copy, prefix_cache)
    short = Slot(seq=0, tokens=list(old))
    assert short.reuse_shifted(_FakeKV(old), None, new, 1, 200) == 1  # no run long enough: as truncate
