"""The CPU board's verdicts (backends/cpu_board.py): who steps, who pauses, how the cores are split."""

from __future__ import annotations

import multiprocessing as mp
import time

from llmd.backends.cpu_board import FIM_LEAD_S, STALE_S, Claim, CpuBoard
from llmd.priority import AGING_S

NOW = 1000.0


def board_with(*claims: Claim | None) -> tuple[CpuBoard, list[int]]:
    b = CpuBoard(rows=8)
    rows = [b.take() for _ in claims]
    for row, c in zip(rows, claims, strict=True):
        assert row is not None
        b.publish(row, c, now=NOW)
    return b, rows  # type: ignore[return-value]


def test_alone_a_worker_runs_on_every_thread():
    mine = Claim("agent", False, NOW - 1)
    b, (row,) = board_with(mine)
    v = b.verdict(row, mine, 2, now=NOW)
    assert not v.pause and v.share == 2 and v.others == 0


def test_an_agents_prompt_pauses_for_an_editors_completion_on_another_model():
    agent, fim = Claim("agent", False, NOW - 5), Claim("interactive", True, NOW - 0.1)
    b, (a, f) = board_with(agent, fim)
    assert b.verdict(a, agent, 2, now=NOW).pause
    v = b.verdict(f, fim, 2, now=NOW)
    assert not v.pause and v.share == 2


def test_among_equals_an_editors_completion_goes_first_and_level_work_splits_the_cores():
    chat, fim = Claim("interactive", False, NOW - FIM_LEAD_S / 2), Claim("interactive", True, NOW)
    b, (c, f) = board_with(chat, fim)
    assert b.verdict(c, chat, 2, now=NOW).pause and not b.verdict(f, fim, 2, now=NOW).pause
    # the editor's lead is bounded: a chat that has waited FIM_LEAD_S splits the cores with it
    chat = Claim("interactive", False, NOW - FIM_LEAD_S - 0.1)
    b, (c, f) = board_with(chat, fim)
    vc, vf = b.verdict(c, chat, 2, now=NOW), b.verdict(f, fim, 2, now=NOW)
    assert not vc.pause and not vf.pause and vc.share == vf.share == 1
    chat = Claim("interactive", False, NOW - 5)
    other_chat = Claim("interactive", False, NOW - 1)
    b, (c1, c2) = board_with(chat, other_chat)
    v1, v2 = b.verdict(c1, chat, 2, now=NOW), b.verdict(c2, other_chat, 2, now=NOW)
    assert not v1.pause and not v2.pause and v1.share == v2.share == 1 and "same priority" in v1.why


def test_a_waiting_background_request_rises_to_the_agents_class_but_not_to_a_persons():
    """Aged, an indexer's batch runs level with an agent's prompt on another model; beside a person's
    chat it stays held back (its share comes in turns), and the chat keeps every thread."""
    bg = Claim("background", False, NOW - 2 * AGING_S - 1)  # waited two classes' worth
    agent = Claim("agent", False, NOW - 0.5)
    b, (g, a) = board_with(bg, agent)
    assert not b.verdict(g, bg, 2, now=NOW).pause
    young = Claim("background", False, NOW - 1)
    b, (g, a) = board_with(young, agent)
    assert b.verdict(g, young, 2, now=NOW).pause
    chat = Claim("interactive", False, NOW - 0.5)
    b, (g, c) = board_with(bg, chat)
    assert b.verdict(g, bg, 2, now=NOW).pause
    v = b.verdict(c, chat, 2, now=NOW)
    assert not v.pause and v.share == 2
    old_agent = Claim("agent", False, NOW - 10 * AGING_S)
    b, (a, c) = board_with(old_agent, chat)
    assert b.verdict(a, old_agent, 2, now=NOW).pause


def test_idle_work_pauses_while_another_model_has_requests():
    chat = Claim("background", False, NOW)
    b, (idle, c) = board_with(None, chat)
    assert b.verdict(idle, None, 2, now=NOW).pause
    b.clear(c)
    assert not b.verdict(idle, None, 2, now=NOW).pause


def test_a_stale_or_given_back_row_pauses_nobody():
    agent, fim = Claim("agent", False, NOW), Claim("interactive", True, NOW)
    b, (a, f) = board_with(agent, fim)
    assert not b.verdict(a, agent, 2, now=NOW + STALE_S + 1).pause  # f stopped writing (a stopped process)
    b.give_back(f)
    assert not b.verdict(a, agent, 2, now=NOW).pause
    assert b.take() is not None


def _in_worker(board: CpuBoard, row: int) -> None:
    assert board.take() is None  # the free list stays with the daemon
    board.publish(row, Claim("agent", True, 5.0))


def test_a_worker_process_writes_the_daemons_rows():
    b = CpuBoard(rows=4)
    row = b.take()
    assert row is not None
    p = mp.get_context("spawn").Process(target=_in_worker, args=(b, row))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert b.claims(time.perf_counter()) == [Claim("agent", True, 5.0)]


def test_a_held_back_worker_takes_short_turns_for_its_minimum_share():
    """An agent's prompt held back by an editor's completions that keep coming: once it has waited
    long enough for its share (a turn as long as the last, at 0.2: four times that), its next step
    is a turn; then it waits again. Running in its own right resets the wait."""
    from llmd.backends.cpu_board import Turns

    t = Turns(0.2)
    t.last_turn_s = 0.5  # a turn took 0.5 s: wait 2 s between turns
    assert not t.due(True, 100.0)
    assert not t.due(True, 101.9)
    assert t.due(True, 102.0)  # its turn
    assert not t.due(True, 102.5) and t.last_turn_s == 0.5  # timed: 0.5 s; the wait starts again
    assert not t.due(True, 104.4) and t.due(True, 104.5)
    assert not t.due(False, 105.0)  # it ran in its own right: no wait owed
    assert not t.due(True, 105.1) and not t.due(True, 106.9) and t.due(True, 107.2)
    assert t.turns == 3
    assert not Turns(0.0).due(True, 0.0) and not Turns(0.0).due(True, 1e9)  # strictly by class


def test_background_work_takes_a_quarter_of_the_minimum_share():
    """An indexer's embeddings held back by an agent's prompt: turns four times as far apart as an
    agent's (at the full share its turns took 13% of the CPU from the agent, a class above); the
    board still lets it run level once it has aged."""
    from llmd.backends.cpu_board import BACKGROUND_TURNS, Turns, turn_share

    assert turn_share("agent") == turn_share("interactive") == 1.0 and turn_share("background") == BACKGROUND_TURNS
    t = Turns(0.2)
    t.last_turn_s = 0.5  # at 0.05 of the time: 9.5 s between turns
    assert not t.due(True, 100.0, scale=0.25) and not t.due(True, 109.4, scale=0.25)
    assert t.due(True, 109.5, scale=0.25)
    agent = Claim("agent", False, NOW - 1)
    aged = Claim("background", False, NOW - AGING_S - 0.1)
    b, (a, g) = board_with(agent, aged)
    assert not b.verdict(g, aged, 2, now=NOW).pause


def test_a_claim_on_its_turn_pauses_nobody_and_splits_the_cores():
    agent, fim = Claim("agent", False, NOW - 5), Claim("interactive", True, NOW - 0.1)
    b, (a, f) = board_with(agent, fim)
    assert b.verdict(a, agent, 2, now=NOW).pause
    on_turn = Claim("agent", False, NOW - 5, turn=True)
    b.publish(a, on_turn, now=NOW)
    v = b.verdict(a, on_turn, 2, now=NOW)
    assert not v.pause and v.share == 1 and "turn" in v.why
    v = b.verdict(f, fim, 2, now=NOW)  # the editor's model goes on, on the other core
    assert not v.pause and v.share == 1


def test_one_turn_at_a_time():
    """Two held-back workers (an agent's and an indexer's) beside an editor's: the second waits for
    the first's turn to end, so no more than two run on two cores."""
    from llmd.backends.cpu_board import Turns

    agent, bg, fim = (Claim("agent", False, NOW - 5, turn=True), Claim("background", False, NOW - 9),
                      Claim("interactive", True, NOW))
    b, (a, g, f) = board_with(agent, bg, fim)
    assert b.turn_taken(g, now=NOW) and not b.turn_taken(a, now=NOW)
    t = Turns(0.2)
    t.last_turn_s = 0.1
    assert not t.due(True, 100.0) and not t.due(True, 101.0, taken=True) and t.due(True, 101.1)


def test_a_worker_held_back_lately_reads_its_prompt_in_short_steps():
    """Beside an editor whose completions come every few seconds, an agent's prompt steps are short
    even on its own time, so the step given up for the next completion loses little; ten seconds
    after it was last held back it reads whole micro-batches again."""
    from llmd.backends.cpu_board import CONTENDED_S, TURN_ROWS, Turns

    t = Turns(0.2)
    assert t.step_rows(100.0) is None  # never held back: as many rows as the engine reads
    t.last_turn_s = 0.5
    assert not t.due(True, 100.0) and t.step_rows(100.0) == TURN_ROWS
    assert t.due(True, 102.0) and t.step_rows(102.0) == TURN_ROWS  # its turn
    assert not t.due(False, 103.0) and t.step_rows(103.0) == TURN_ROWS  # its own time, but contended
    assert t.step_rows(102.0 + CONTENDED_S + 0.1) is None
