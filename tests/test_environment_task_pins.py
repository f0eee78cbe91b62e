"""Every environment record a commit writes names its task, so the checkpoint restores.

An environment record is `{"task_digest", "boundary"}`; `validate_record` refuses one without
a 64-character digest, and a restore installs all or nothing. The digest came from the running
episode's pin, which `end_task` dropped: a finished episode's outcome (kept for a caller whose
reply was cut by the checkpoint) then went out with `task_digest: ""` unless the outcome itself
happened to carry a `task_digest` key (the project's own replies do; a library user's need
not), and the whole checkpoint failed at the restore that needed it. Now the pin stays while
the outcome is held, and an episode whose task is unknown fails the Commit instead, typed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rollout_checkpoint.server.core.checkpoint_storage import PartStorage
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.episodic.episode_participant import (
    EnvironmentParticipant,
    task_digest,
)
from rollout_checkpoint.server.runtime.control_plane import ControlPlane, ControlSettings
from rollout_checkpoint.server.runtime.participant import ExportRecord, RestoredRecord
from rollout_checkpoint.server.runtime.record_stamps import PRUNE_FLOOR

TASK = {"task_id": "t1", "environment": {"x": 1}}
R = EpisodeId("r", 1)


@pytest.fixture
async def environment() -> AsyncIterator[EnvironmentParticipant]:
    participant = EnvironmentParticipant("env")
    control = ControlPlane(participant, ControlSettings(), storage=PartStorage())
    await control.start()
    try:
        yield participant
    finally:
        await control.close()


async def restored_into_a_fresh_environment(
    records: list[ExportRecord],
) -> EnvironmentParticipant:
    fresh = EnvironmentParticipant("env")
    control = ControlPlane(fresh, ControlSettings(), storage=PartStorage())
    await control.start()
    try:
        await fresh.install([RestoredRecord(r.episode_id, dict(r.fields)) for r in records])
    finally:
        await control.close()
    return fresh


async def test_a_finished_outcome_without_a_digest_of_its_own_restores(
    environment: EnvironmentParticipant,
) -> None:
    tracked, _ = environment.begin_task(R, TASK)
    environment.episodes_tracker.finish(tracked, {"reward": 1.0})  # no task_digest in it
    environment.end_task(tracked)
    records = list(await environment.export(frozenset({R})))
    assert [dict(r.fields) for r in records] == [
        {"task_digest": task_digest(TASK), "boundary": {"reward": 1.0}}
    ]
    fresh = await restored_into_a_fresh_environment(records)
    assert fresh.restored_pending() == {R.next_attempt()}
    with pytest.raises(CheckpointError) as mismatch:  # the pin came back with the outcome
        fresh.begin_task(R.next_attempt(), {"task_id": "other"})
    assert mismatch.value.reason is Reason.TASK_MISMATCH


async def test_an_episode_without_a_task_fails_the_export_typed(
    environment: EnvironmentParticipant,
) -> None:
    tracked, _ = environment.begin(R)  # the base class's begin: no task pinned
    environment.episodes_tracker.finish(tracked, {"reward": 1.0})
    with pytest.raises(CheckpointError) as refused:
        await environment.export(frozenset({R}))
    assert refused.value.reason is Reason.HOOK_FAILED
    assert refused.value.metadata["captureKey"] == R.capture_key


async def test_the_pins_of_released_outcomes_go(environment: EnvironmentParticipant) -> None:
    """Bounded by the outcomes held: a commit releases delivered outcomes and their pins;
    without commits, pruning past twice the last count keeps them bounded too."""
    steps = environment.episodes_tracker
    count = 3 * PRUNE_FLOOR
    for number in range(count):
        episode = EpisodeId(f"r{number}", 1)
        tracked, _ = environment.begin_task(episode, {"task_id": f"t{number}"})
        steps.finish(tracked, {"reward": number})
        environment.end_task(tracked)
        steps.delivered(episode)  # the caller has it: kept only until the next commit
    assert len(environment._outcome_digests) <= count
    steps.open()  # a checkpoint ended: no caller holds a delivered reply any more
    tracked, _ = environment.begin_task(EpisodeId("last", 1), TASK)
    steps.finish(tracked, {"reward": -1})
    environment.end_task(tracked)
    environment.committed(frozenset({EpisodeId("last", 1)}))
    assert set(environment._outcome_digests) == {EpisodeId("last", 1).capture_key}
    records = await environment.export(frozenset({EpisodeId("last", 1)}))
    assert [r.fields["task_digest"] for r in records] == [task_digest(TASK)]
