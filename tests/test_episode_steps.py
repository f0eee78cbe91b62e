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
