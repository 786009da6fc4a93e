"""The draft model's catch-up of a long context is spread over steps, and the idle cost
measurement gives way to a waiting command: neither holds the step thread (and every other
stream) for a whole prefill. Real llama.cpp contexts on the packaged model."""

from __future__ import annotations

import pytest

from llmd.backends.llamacpp.draft_model import CATCHUP_STEP, DraftModel
from llmd.backends.repack import repack_for
from llmd.models.catalog import find_packaged

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def draft() -> DraftModel:
    path = find_packaged()["smollm2-135m"]
    # in this process: repacking only where it does not crash (a trial load says; AMX CPUs crash)
    m = DraftModel(str(path), 1024, 2, 2, 49152, repack=repack_for([str(path)]))
    yield m
    m.close()


def test_a_long_catch_up_is_spread_over_steps(draft: DraftModel):
    context = [1] + [(i * 37) % 4000 + 100 for i in range(600)]
    pieces = 0
    while len(context) - len(draft.seqs[0]) > CATCHUP_STEP:  # far behind: one piece per step, no drafts
        before = len(draft.seqs[0])
        assert draft.propose([(0, context, 4)]) == [[]]
        assert len(draft.seqs[0]) - before == CATCHUP_STEP
        pieces += 1
    assert pieces == (len(context) - 1) // CATCHUP_STEP
    draft.propose([(0, context, 4)])  # the rest shares the first drafting round
    assert draft.seqs[0][: len(context)] == context


def test_a_short_catch_up_drafts_at_once_beside_a_long_one(draft: DraftModel):
    short = [1, 200, 201, 202]
    long = [1] + list(range(300, 800))
    out = draft.propose([(0, short, 2), (1, long, 2)])
    assert out[1] == [] and len(draft.seqs[1]) == CATCHUP_STEP  # the long one caught up one piece
    assert draft.seqs[0][: len(short)] == short  # the short one was brought in line (and drafted)


def test_cost_measurement_gives_way_to_a_command():
    import llama_cpp as L

    from llmd.backends.llamacpp.speculation import Speculator

    path = str(find_packaged()["smollm2-135m"])
    d = DraftModel(path, 256, 1, 2, 49152, repack=repack_for([path]))
    try:
        spec = Speculator()
        assert spec.measure_cost(d._llama_decode, d.batch, d.mem, 0, 1, interrupted=lambda: True) is False
        assert spec.cost == {}
        L.llama_memory_seq_rm(d.mem, 0, -1, -1)
        # a command after the first point's three timings: that point is kept, nothing is used yet
        checks = iter([False] * 3 + [True])
        assert spec.measure_cost(d._llama_decode, d.batch, d.mem, 0, 1, interrupted=lambda: next(checks)) is False
        assert spec.cost == {} and sorted(spec.measured) == [0]
        L.llama_memory_seq_rm(d.mem, 0, -1, -1)
        # the next idle moment measures only the rest: the context, then 3 timings of each of 4 points
        decodes = []

        def counted(batch: object) -> int:
            decodes.append(batch)
            return d._llama_decode(batch)

        assert spec.measure_cost(counted, d.batch, d.mem, 0, 1) is True
        assert sorted(spec.cost) == [0, 1, 2, 4, 8] and len(decodes) == 1 + 3 * 4
    finally:
        d.close()
