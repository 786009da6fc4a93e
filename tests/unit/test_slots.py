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
