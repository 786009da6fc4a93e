"""Copying a shared prefix between slots: only where the copy costs less than the prefill it saves."""

from __future__ import annotations

from llmd.backends.llamacpp.kv_copy import PrefixCopier, lost
from llmd.backends.llamacpp.slots import Slot


class FakeLlama:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def llama_memory_seq_rm(self, mem, seq, p0, p1):
        self.calls.append(("rm", seq, p0, p1))

    def llama_memory_seq_cp(self, mem, src, dst, p0, p1):
        self.calls.append(("cp", src, dst, p0, p1))


def reusable(slot: Slot, prompt: list[int]) -> int:
    return slot.reusable(prompt, 64, exact=False)


def test_the_copy_pays_by_the_measured_prefill_cost():
    # a 1.5B model's slot stream at 4096 tokens (115 MB, ~29 ms to copy) against 6 ms a token
    big = PrefixCopier(4096 * 28672, 0.006)
    assert big.pays(24) and not big.pays(5)
    # a 135M model prefills 20x faster: the same prefix is cheaper to compute than to copy
    small = PrefixCopier(4096 * 23040, 0.0005)
    assert not small.pays(24) and small.pays(200)
    for _ in range(20):  # measured prefill steps move the estimate
        small.observe_prefill(512, 512 * 0.005)
    assert small.pays(24)
    small.observe_prefill(8, 100.0)  # a few tokens say little about the per-token cost: ignored
    assert abs(small.prefill_token_s - 0.005) < 0.001


def test_the_source_is_the_slot_holding_most_of_the_prompt():
    shared = list(range(100))
    slots = [Slot(0, tokens=shared + [7, 7]), Slot(1, tokens=shared[:40]), Slot(2, tokens=[5, 5, 5]), Slot(3)]
    copier = PrefixCopier(4096 * 28672, 0.006)
    prompt = shared + [9, 9, 9]
    assert copier.source(slots, slots[3], prompt, 0, reusable) == (slots[0], 100)
    # the target holds almost as much itself: copying would save too little
    assert copier.source(slots, slots[1], prompt, 95, reusable) is None
    # never the target itself
    assert copier.source(slots[:1], slots[0], prompt, 0, reusable) is None


def test_a_copy_takes_the_sources_tokens_and_drops_the_targets():
    L = FakeLlama()
    src, dst = Slot(0, tokens=list(range(50)), saved=40), Slot(2, tokens=[9] * 30, tail=[1, 2], saved=30)
    copier = PrefixCopier(1000, 0.01)
    copier.copy(L, None, src, dst, 20)
    assert dst.tokens == list(range(20)) and dst.saved == 20 and dst.tail == []
    assert L.calls == [("rm", 2, -1, -1), ("cp", 0, 2, -1, -1), ("rm", 2, 20, -1)]
    assert copier.info()["copies"] == 1 and copier.info()["tokens"] == 20


def test_what_a_slot_would_lose_and_what_a_copy_serves():
    held = Slot(0, tokens=list(range(51)), saved=0)
    assert lost(held, 26) == 25  # its other 25 tokens are gone once a prompt sharing 26 lands there
    assert lost(Slot(1, tokens=list(range(300)), saved=300), 3) == 0  # the prefix cache keeps them
    assert lost(Slot(2), 0) == 0
    copier = PrefixCopier(4096 * 28672, 0.01)  # 29 ms a copy: about 3 prefill tokens
    # an empty slot serves what another slot holds, less the copy's cost; more than overwriting
    # the slot that holds it would keep (26 served, 25 lost)
    assert 22 < copier.served(0, 26) < 24
    assert copier.served(25, 26) == 25  # one token is not worth a copy


def test_a_queued_copy_holds_its_source_and_its_target_is_no_source_until_the_next_decode():
    """llama.cpp applies a copy between streams at the next decode, while a prefix restore or a
    truncation writes at once: the source must stay as it is until then (else the copying request
    gets the restored KV, silently), and the target holds the tokens, not their KV, until then."""
    L = FakeLlama()
    shared = list(range(100))
    src, dst, other = Slot(0, tokens=shared), Slot(1), Slot(2)
    copier = PrefixCopier(4096 * 28672, 0.006)
    assert not copier.held(src, 5)
    copier.copy(L, None, src, dst, 100, decodes=5)
    assert copier.held(src, 5) and not copier.held(dst, 5) and not copier.held(other, 5)
    # the target is not a source yet: the next request copies from the slot that has the KV
    assert copier.source([src, dst, other], other, shared + [1], 0, reusable, decodes=5) == (src, 100)
    assert copier.source([dst, other], other, shared + [1], 0, reusable, decodes=5) is None
    # a decode ran: the copy is applied, nothing is held
    assert not copier.held(src, 6)
    assert copier.source([dst, other], other, shared + [1], 0, reusable, decodes=6) == (dst, 100)
