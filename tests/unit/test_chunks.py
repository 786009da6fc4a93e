"""Exact-policy chunks: cut at the grid and right after each end-of-turn token."""

from llmd.backends.llamacpp.chunks import ChunkGrid
from llmd.backends.llamacpp.slots import Slot

EOT = 2
grid = ChunkGrid(8, lambda t: t == EOT)


def test_chunks_end_at_the_grid_or_after_an_end_of_turn():
    tokens = [5, 5, 5, EOT, 5, 5, 5, 5, 5, 5, 5, 5, 5]
    assert grid.chunk_end(tokens, 0) == 4  # right after the end of turn
    assert grid.chunk_end(tokens, 4) == 8  # then the grid
    assert grid.chunk_end(tokens, 8) == 13  # the end of the tokens
    assert grid.is_boundary(tokens, 4) and grid.is_boundary(tokens, 8) and not grid.is_boundary(tokens, 13)


def test_whole_and_turn_by_turn_prefill_see_the_same_chunks():
    turn1 = [5, 5, 5, 5, 5, EOT, 5, 5, 5, 5]
    whole = turn1 + [5, 5, EOT, 5, 5, 5]
    cuts_whole, pos = [], 0
    while pos < len(whole):
        pos = grid.chunk_end(whole, pos)
        cuts_whole.append(pos)
    assert 6 in cuts_whole and 8 in cuts_whole and 13 in cuts_whole


def test_reprefill_only_whole_chunks():
    slot = Slot(seq=0, tokens=[5] * 12, exact=8)
    assert grid.reprefill_end(slot) is None  # 4 decoded tokens past exact: not a whole chunk
    slot = Slot(seq=0, tokens=[5] * 17, exact=8)
    assert grid.reprefill_end(slot) == 16


def test_exact_reuse_stops_at_a_boundary():
    slot = Slot(seq=0, tokens=[5, 5, 5, EOT, 5, 5, 5, 5, 5, 5], exact=10)
    prompt = [5, 5, 5, EOT, 5, 5, 9, 9, 9]
    assert slot.reusable(prompt, 8, True, lambda t: t == EOT) == 4
    assert slot.reusable(prompt, 8, False) == 6  # fast: token by token
