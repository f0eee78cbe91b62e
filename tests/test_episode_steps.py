"""Episode steps: boundaries, parking, wait and replay steps, export, restore, retire."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.episodic.episode_steps import (
    NO_BOUNDARY,
    EpisodeRefused,
    EpisodeRetired,
    EpisodeSteps,
    Phase,
    StepMode,
)
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[EpisodeSteps, RetiredAttempts, Clock]:
    marks = RetiredAttempts()
    clock = Clock()
    return EpisodeSteps(lambda: marks, lambda: None, clock), marks, clock


async def test_a_sealed_owner_refuses_awaiting_restore_and_a_checkpoint_admission_closed() -> None:
    sealed = True
    steps = EpisodeSteps(lambda: RetiredAttempts(), lambda: None, Clock(), sealed=lambda: sealed)
    steps.close()  # a start_closed process closes admission before any request
    with pytest.raises(EpisodeRefused) as refused:
        steps.begin(EpisodeId("r1"))
    assert refused.value.code == "awaiting_restore"
    sealed = False
    steps.open()
    steps.begin(EpisodeId("r1"))
    steps.close()  # a checkpoint
    with pytest.raises(EpisodeRefused) as refused:
        steps.begin(EpisodeId("r2"))
    assert refused.value.code == "admission_closed"


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_boundary_parks_while_closed_and_a_new_close_keeps_it_parked() -> None:
    steps, _, clock = make()
    passed: list[int] = []

    async def episode() -> None:
        tracked, restored = steps.begin(EpisodeId("r1"))
        assert restored is NO_BOUNDARY
        await steps.boundary(tracked, {"step": 0})
        passed.append(0)
        await steps.boundary(tracked, {"step": 1})
        passed.append(1)
        steps.end(tracked)

    steps.close()
    with pytest.raises(EpisodeRefused) as refused:
        steps.begin(EpisodeId("late"))
    assert refused.value.code == "admission_closed"
    steps.open()
    task = asyncio.ensure_future(episode())
    await settle()
    assert passed == [0, 1] and task.done()

    steps2, _, clock = make()
    gate = asyncio.Event()

    async def parked_episode() -> None:
        tracked, _ = steps2.begin(EpisodeId("r2"))
        await gate.wait()
        await steps2.boundary(tracked, {"step": 0})
        passed.append(2)
        steps2.end(tracked)

    task = asyncio.ensure_future(parked_episode())
    await settle()
    assert not steps2.ready()  # running between boundaries: a blocker
    steps2.close()
    gate.set()
    await settle()
    assert steps2.ready() and steps2.episodes["r2"].phase is Phase.PARKED
    assert steps2.export(None) == [(EpisodeId("r2"), {"step": 0})]
    clock.now += 30
    # Resume, and close again before the parked episode got to run: it stays parked.
    steps2.open()
    steps2.close()
    await settle()
    assert 2 not in passed and steps2.episodes["r2"].phase is Phase.PARKED
    steps2.open()
    await task
    assert passed[-1] == 2


async def test_parked_time_does_not_count_against_the_episode() -> None:
    steps, _, clock = make()
    tracked, _ = steps.begin(EpisodeId("r1"))
    clock.now += 5
    steps.close()
    parked = asyncio.ensure_future(steps.boundary(tracked, {}))
    await settle()
    clock.now += 100
    steps.open()
    await parked
    clock.now += 2
    assert tracked.active_seconds(clock.now) == pytest.approx(7)


async def test_wait_and_replay_steps() -> None:
    steps, _, _ = make()
    tracked, _ = steps.begin(EpisodeId("r1"))
    await steps.boundary(tracked, {"before": "verify"})
    release = asyncio.Event()

    async def run(mode: StepMode) -> None:
        async with steps.step(tracked, mode):
            await release.wait()

    task = asyncio.ensure_future(run(StepMode.WAIT))
    await settle()
    assert not steps.ready()
    assert steps.blockers()[0][0].capture_key == "r1"
    assert steps.export(None) == []  # a wait step is never cut in the middle
    release.set()
    await task
    assert steps.ready() is False  # running again until the next boundary
    await steps.boundary(tracked, {"before": "model"})
    release = asyncio.Event()
    task = asyncio.ensure_future(run(StepMode.REPLAY))
    await settle()
    assert steps.ready()
    assert steps.export(None) == [(EpisodeId("r1"), {"before": "model"})]
    # The replay step's result arrives during a checkpoint: it is held until resume.
    steps.close()
    release.set()
    await settle()
    assert not task.done() and steps.ready()
    steps.open()
    await task


async def test_no_boundary_yet_exports_null_and_restored_boundaries_are_handed_out_once() -> None:
    steps, _, _ = make()
    tracked, _ = steps.begin(EpisodeId("r1"))
    replay = steps.step(tracked, StepMode.REPLAY)
    await replay.__aenter__()
    assert steps.export(None) == [(EpisodeId("r1"), None)]
    await replay.__aexit__(None, None, None)

    restored, _, _ = make()
    restored.install({EpisodeId("r5", 1): {"step": 3}})
    assert restored.restored_pending() == {EpisodeId("r5", 1)}
    # A checkpoint before the replacement starts carries the restored boundary forward (N+1).
    assert restored.export(frozenset({EpisodeId("r5", 1)})) == [(EpisodeId("r5", 1), {"step": 3})]
    episode, boundary = restored.begin(EpisodeId("r5", 1))
    assert boundary == {"step": 3} and episode.restored
    restored.end(episode)
    _, again = restored.begin(EpisodeId("r5", 1))
    assert again is NO_BOUNDARY


async def test_retire_cancels_once_waits_for_the_end_and_refuses_duplicates() -> None:
    steps, marks, _ = make()
    cleanup_done = asyncio.Event()
    cancelled: list[int] = []

    async def episode() -> None:
        tracked, _ = steps.begin(EpisodeId("r1", 2))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(1)
            await cleanup_done.wait()  # its final cleanup is never interrupted
            raise
        finally:
            steps.end(tracked)

    task = asyncio.ensure_future(episode())
    await settle()
    with pytest.raises(EpisodeRefused, match="already running"):
        steps.begin(EpisodeId("r1", 2))
    marks.mark(EpisodeId("r1", 2))
    retire = asyncio.ensure_future(steps.retire(EpisodeId("r1", 2)))
    await settle()
    assert cancelled == [1] and not retire.done()
    assert not steps.ready()  # being retired blocks
    retry = asyncio.ensure_future(steps.retire(EpisodeId("r1", 2)))
    await settle()
    assert cancelled == [1]  # cancelled once
    cleanup_done.set()
    await asyncio.gather(retire, retry)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps.ready() and steps.export(None) == []
    with pytest.raises(EpisodeRefused) as refused:
        steps.begin(EpisodeId("r1", 1))
    assert refused.value.code == "stale_attempt"


async def test_an_episode_retired_while_parked_stops_there() -> None:
    steps, marks, _ = make()
    tracked, _ = steps.begin(EpisodeId("r1"))
    steps.close()
    parked = asyncio.ensure_future(steps.boundary(tracked, {}))
    await settle()
    marks.mark(EpisodeId("r1"))
    steps.open()
    with pytest.raises(EpisodeRetired):
        await parked


async def test_blockers_are_counted_incrementally_and_capped() -> None:
    steps, _, _ = make()
    tracked: list[Any] = [steps.begin(EpisodeId(f"r{i:03d}"))[0] for i in range(150)]
    listed, count = steps.blockers()
    assert count == 150 and len(listed) == 100 and listed[0].capture_key == "r000"
    for episode in tracked[:60]:
        steps.close()
        task = asyncio.ensure_future(steps.boundary(episode, {}))
        await settle()
        steps.open()
        await task
        await steps.boundary(episode, {})
        steps.end(episode)
    assert steps.blockers()[1] == 90


# -- finished episodes: what an owner keeps of them (outcomes.py) ------------------------------


def finished(steps: EpisodeSteps, key: str, outcome: Any = None) -> EpisodeId:
    episode = EpisodeId.from_capture_key(key)
    tracked, _ = steps.begin(episode)
    steps.finish(tracked, {"done": key} if outcome is None else outcome)
    return episode


def listed(steps: EpisodeSteps) -> list[tuple[str, bool]]:
    return sorted((i.episode_id.capture_key, i.at_boundary) for i in steps.episode_infos())


async def test_an_outcome_is_listed_while_its_reply_is_on_the_wire_and_not_once_delivered() -> None:
    steps, _, _ = make()
    r1 = finished(steps, "r1")
    # On the wire: a derived scope must name it, and a commit of that scope exports it.
    assert listed(steps) == [("r1", True)]
    assert steps.export(frozenset({r1})) == [(r1, {"done": "r1"})]
    steps.delivered(r1)
    assert listed(steps) == []
    steps.close()
    steps.committed(frozenset())
    assert steps.export(frozenset({r1})) == []
    assert steps.counts()["outcomes"] == 0


async def test_a_reply_delivered_before_the_close_is_exported_for_a_caller_holding_it() -> None:
    # The caller (an environment) closed first and holds the reply unread: its episode is cut
    # at the boundary before the call and names this one in the scope.
    steps, _, _ = make()
    r1 = finished(steps, "r1")
    steps.delivered(r1)
    steps.close()
    assert steps.export(frozenset({r1})) == [(r1, {"done": "r1"})]
    steps.committed(frozenset({r1}))  # exported: nothing needs it any more
    assert steps.export(frozenset({r1})) == []
    # A checkpoint that ends without a commit here (an abort) releases it at the reopening.
    steps.open()
    r2 = finished(steps, "r2")
    steps.delivered(r2)
    steps.close()
    assert steps.export(frozenset({r2})) == [(r2, {"done": "r2"})]
    steps.open()
    steps.close()
    assert steps.export(frozenset({r2})) == []


async def test_a_failed_delivery_keeps_the_outcome_unlisted_until_a_commit_leaves_it_out() -> None:
    steps, _, _ = make()
    r1 = finished(steps, "r1")
    steps.delivery_failed(r1)
    assert listed(steps) == []
    steps.close()
    steps.committed(frozenset({r1}))  # a controller that still counts it in flight
    assert steps.export(frozenset({r1})) == [(r1, {"done": "r1"})]
    steps.open()  # a reopening keeps it: nobody has the reply
    steps.close()
    steps.committed(frozenset({EpisodeId("other")}))
    assert steps.export(frozenset({r1})) == []


async def test_delivered_outcomes_are_bounded_by_the_most_episodes_live_at_once() -> None:
    steps, _, _ = make()
    running = [steps.begin(EpisodeId(f"w{i}"))[0] for i in range(100)]
    for tracked in running:
        steps.finish(tracked, {"done": tracked.episode_id.capture_key})
        steps.delivered(tracked.episode_id)
    for i in range(1000):  # one at a time: the peak stays 100
        steps.delivered(finished(steps, f"s{i}"))
    assert steps.counts()["outcomes"] == 100
    assert steps.export(frozenset({EpisodeId("s999")})) != []
    assert steps.export(frozenset({EpisodeId("s899")})) == []
    steps.close()
    steps.open()
    assert steps.counts()["outcomes"] == 0


async def test_an_unscoped_commit_keeps_outcomes_on_the_wire_and_a_new_run_supersedes_one() -> None:
    steps, _, _ = make()
    r1 = finished(steps, "r1", {"done": "first"})
    steps.close()
    steps.committed(None)
    assert listed(steps) == [("r1", True)]
    steps.open()
    tracked, _ = steps.begin(r1)  # the caller runs the key again: the old outcome is moot
    assert listed(steps) == [("r1", False)]
    steps.finish(tracked, {"done": "second"})
    assert steps.export(frozenset({r1})) == [(r1, {"done": "second"})]


async def test_change_stamps_stay_bounded_by_what_is_held_without_any_commit() -> None:
    """The change stamps of an incremental export are pruned at every commit, and also when
    they outgrow what the last pruning kept: a server that never commits (or whose commits
    keep failing) must not keep a stamp for every episode it ever ran."""
    bound = 2 * 1024 + 1  # twice what the last pruning kept, plus the floor
    steps, _, _ = make()
    for index in range(20_000):
        episode, _ = steps.begin(EpisodeId(f"r{index}"))
        steps.end(episode)
    assert len(steps.stamps) <= bound
    steps.begin(EpisodeId("live"))
    for index in range(5_000):
        episode, _ = steps.begin(EpisodeId(f"s{index}"))
        steps.end(episode)
    assert len(steps.stamps) <= bound
    assert "live" in steps.stamps  # a held episode keeps its stamp through every pruning
