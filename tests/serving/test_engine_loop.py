"""EngineLoop, the queue every engine's loop thread takes its requests from."""

from __future__ import annotations

from serving.engine.base import EngineLoop


def test_requests_whose_caller_left_take_no_place_in_a_round():
    loop: EngineLoop[str] = EngineLoop()
    loop.alive = True  # as start() leaves it, without a thread: next_round is called here
    for name in ("left-1", "live-1", "left-2", "live-2", "live-3"):
        loop.submit(name)
    jobs, taken = loop.next_round(busy=True, room=2, gone=lambda name: name.startswith("left"))
    assert (jobs, taken) == ([], ["live-1", "live-2"])
    assert list(loop.waiting) == ["live-3"]  # the ones gone left the queue, not just this round


def test_without_gone_a_round_takes_the_oldest_up_to_its_room():
    loop: EngineLoop[str] = EngineLoop()
    loop.alive = True
    for name in ("a", "b", "c"):
        loop.submit(name)
    assert loop.next_round(busy=True, room=2) == ([], ["a", "b"])
    assert loop.next_round(busy=True, room=None) == ([], ["c"])
