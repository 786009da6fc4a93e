"""Copying a shared prefix between slots: through the sequence state (the source's used cells only,
written at once), and only where the copy costs less than the prefill it saves."""

from __future__ import annotations

from llmd.backends.llamacpp.kv_copy import PrefixCopier, lost
from llmd.backends.llamacpp.slots import Slot

QWEN_1_5B_KV_TOKEN = 28672  # bytes of K and V per token: 28 layers x 2 KV heads x 128 x f16 x 2


class FakeLlama:
    """The state calls the copy makes, on sequences that are lists of (position, value) cells."""

    def __init__(self, seqs: dict[int, list[int]]) -> None:
        self.calls: list[tuple] = []
        self.seqs = seqs

    def llama_state_seq_get_size(self, ctx, seq):
        return 4 * len(self.seqs.get(seq, [])) + 4

    def llama_state_seq_get_data(self, ctx, buf, size, seq):
        self.calls.append(("get", seq))
        cells = self.seqs.get(seq, [])
        data = len(cells).to_bytes(4, "little") + b"".join(c.to_bytes(4, "little") for c in cells)
        buf[:len(data)] = list(data)
        return len(data)

    def llama_state_seq_set_data(self, ctx, buf, size, seq):
        self.calls.append(("set", seq))
        raw = bytes(buf[:size])
        n = int.from_bytes(raw[:4], "little")
        self.seqs[seq] = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "little") for i in range(n)]
        return size

    def llama_memory_seq_rm(self, mem, seq, p0, p1):
        self.calls.append(("rm", seq, p0, p1))
        if p0 >= 0:
            del self.seqs.setdefault(seq, [])[p0:]
        else:
            self.seqs[seq] = []


def reusable(slot: Slot, prompt: list[int]) -> int:
    return slot.reusable(prompt, 64, exact=False)


def test_the_copy_pays_by_the_measured_prefill_cost_and_the_sources_size():
    big = PrefixCopier(QWEN_1_5B_KV_TOKEN, 0.006)  # a 1.5B model: 6 ms a prefilled token
    assert big.pays(24, 100) and not big.pays(1, 2000)
    # the source's whole state moves, whatever the prefix: a 19-token system prompt held by a
    # slot with a long conversation behind it is cheaper to compute
    assert big.pays(19, 40) and not big.pays(19, 30_000)
    # the automatic context does not make copies dear (a whole-stream copy of 32,768 cells did)
    assert big.copy_s(40) < 0.002  # measured: 0.3-0.9 ms for 20 tokens
    small = PrefixCopier(23040, 0.0005)  # a 135M model prefills 12x faster
    assert not small.pays(3, 1000) and small.pays(200, 200)
    for _ in range(20):  # measured prefill steps move the estimate
        small.observe_prefill(512, 512 * 0.005)
    assert abs(small.prefill_token_s - 0.005) < 0.001
    small.observe_prefill(8, 100.0)  # a few tokens say little about the per-token cost: ignored
    assert abs(small.prefill_token_s - 0.005) < 0.001


def test_the_source_is_the_slot_holding_most_of_the_prompt():
    shared = list(range(100))
    slots = [Slot(0, tokens=shared + [7, 7]), Slot(1, tokens=shared[:40]), Slot(2, tokens=[5, 5, 5]), Slot(3)]
    copier = PrefixCopier(QWEN_1_5B_KV_TOKEN, 0.002)
    prompt = shared + [9, 9, 9]
    assert copier.source(slots, slots[3], prompt, 0, reusable) == (slots[0], 100)
    # the target holds almost as much itself: copying would save too little
    assert copier.source(slots, slots[1], prompt, 99, reusable) is None
    # never the target itself
    assert copier.source(slots[:1], slots[0], prompt, 0, reusable) is None


def test_a_copy_is_written_at_once_and_a_later_write_to_the_source_cannot_reach_it():
    """llama.cpp's own stream copy was applied at the next decode, so a prefix restore into the
    source in the same admission round became what the copying request got, silently."""
    L = FakeLlama({0: list(range(50)), 2: [9] * 30})
    src, dst = Slot(0, tokens=list(range(50)), saved=40), Slot(2, tokens=[9] * 30, tail=[1, 2], saved=30)
    copier = PrefixCopier(1000, 0.01)
    assert copier.copy(L, None, None, src, dst, 20)
    assert dst.tokens == list(range(20)) and dst.saved == 20 and dst.tail == []
    assert L.seqs[2] == list(range(20))  # the target holds the KV now, not at the next decode
    L.seqs[0] = [7] * 50  # a restore or a truncation of the source afterwards
    assert L.seqs[2] == list(range(20))
    assert copier.info()["copies"] == 1 and copier.info()["tokens"] == 20


def test_a_refused_state_empties_the_target():
    class Refusing(FakeLlama):
        def llama_state_seq_set_data(self, ctx, buf, size, seq):
            return 0

    L = Refusing({0: list(range(50))})
    dst = Slot(1, tokens=[3, 3])
    assert not PrefixCopier(1000, 0.01).copy(L, None, None, Slot(0, tokens=list(range(50))), dst, 20)
    assert dst.tokens == []


def test_what_a_slot_would_lose_and_what_a_copy_serves():
    held = Slot(0, tokens=list(range(51)), saved=0)
    assert lost(held, 26) == 25  # its other 25 tokens are gone once a prompt sharing 26 lands there
    assert lost(Slot(1, tokens=list(range(300)), saved=300), 3) == 0  # the prefix cache keeps them
    assert lost(Slot(2), 0) == 0
    copier = PrefixCopier(QWEN_1_5B_KV_TOKEN, 0.01)
    # an empty slot serves what another slot holds, less the copy's cost: more than overwriting
    # the slot that holds it would keep (26 served, 25 lost)
    assert 25 < copier.served(0, 26, 51) < 26
    assert copier.served(25, 26, 5000) == 25  # one token is not worth copying a long conversation


def test_a_slot_whose_shift_is_pending_is_never_a_source():
    """reuse_shifted leaves the keys' re-rotation to the next llama_decode: a state read before it
    would carry keys rotated for the old positions into another slot."""
    shared = list(range(100))
    slots = [Slot(0, tokens=shared + [7, 7], shift_pending=True), Slot(1, tokens=shared[:60]), Slot(2)]
    copier = PrefixCopier(QWEN_1_5B_KV_TOKEN, 0.002)
    assert copier.source(slots, slots[2], shared + [9], 0, reusable) == (slots[1], 60)
