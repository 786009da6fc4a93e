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
    assert slot.shift_serves(new, 1, 64) == 101 and kv.cells == dict(enumerate(old))  # asked: nothing moved
    served = slot.reuse_shifted(kv, None, new, 1, 64)
    assert served == 101  # the common start and the slid run; after the edit, computed again
    assert slot.tokens == new[:served] and kv.cells == dict(enumerate(new[:served]))
    assert slot.shift_pending  # until the next llama_decode: neither copied nor saved (kv_copy, prefix_cache)
    short = Slot(seq=0, tokens=list(old))
    assert short.reuse_shifted(_FakeKV(old), None, new, 1, 200) == 1  # no run long enough: as truncate


def _runs_token_by_token(cache: list[int], prompt: list[int], n: int, min_run: int) -> list[tuple[int, int, int]]:
    """shifted_runs as first written: the reference the fast search must agree with."""
    runs, head_c, head_p, end = [], n, n, len(prompt) - 1
    while head_c < len(cache) and head_p < end:
        m = 0
        while head_c + m < len(cache) and head_p + m < end and cache[head_c + m] == prompt[head_p + m]:
            m += 1
        if m >= min_run:
            runs.append((head_c, head_p, m))
            head_c, head_p = head_c + m, head_p + m
        else:
            head_c += 1
    return runs


def test_shifted_runs_agree_with_a_token_by_token_scan():
    import random

    from llmd.backends.llamacpp.slots import shifted_runs

    rng = random.Random(5)
    for _ in range(400):
        alphabet = rng.choice([2, 3, 50, 70000])  # few kinds: near misses everywhere; many: few
        cache = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 300))]
        prompt = cache[:rng.randrange(0, len(cache) + 1)]
        cut = rng.randrange(0, len(prompt) + 1)
        prompt = prompt[:cut] + [rng.randrange(alphabet) for _ in range(rng.randrange(0, 5))] + cache[cut + 3:]
        n, min_run = rng.randrange(0, 4), rng.choice([1, 2, 4, 16])
        assert shifted_runs(cache, prompt, n, min_run) == _runs_token_by_token(cache, prompt, n, min_run)
    # tokens whose 4-byte forms overlap across boundaries: a byte match that is not a token match
    cache, prompt = [0x01000000, 0x00000001, 7, 1, 1], [9, 1, 1, 5]
    assert shifted_runs(cache, prompt, 1, 2) == _runs_token_by_token(cache, prompt, 1, 2)
