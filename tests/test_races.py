"""Races between a Commit or a Restore and the Resume that aborts it, many rounds each.

Each round starts both calls with a random offset of up to a few milliseconds, so the Resume
lands in every phase of the other call (export, write, publication, read, install, done). What
must hold in every round, whatever the interleaving:

* both calls answer, typed: the Commit is COMMITTED or `STALE_CHECKPOINT`, the Restore is
  RESTORED or `STALE_CHECKPOINT` (never INTERNAL, never no answer at all);
* admission is open afterwards and the participant is IDLE;
* a Commit that answered COMMITTED left a part that reads back whole; a part directory never
  holds a records file that no manifest names once its writer has ended;
* a Restore that answered STALE left nothing installed and the process fresh.

The default size runs in the suite; `-m slow` runs the enlarged rounds reported in the issue's
closing note.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.v1 import types_pb2

from .conftest import Harness, drain, start_harness, stop_harness
from .test_load import only_when_asked_for

STATES = {EpisodeId(f"r{i}"): {"n": i, "pad": "x" * 200} for i in range(400)}
PART = ("participants", "resources", "double")


async def outcome(call: asyncio.Future[object]) -> str:
    try:
        await asyncio.wait_for(call, 30)
    except ControlError as error:
        return error.reason
    return "ok"


async def settled(h: Harness) -> None:
    """Wait until no commit job or restore job of the control plane is still running."""
    await h.until(
        lambda: (
            (h.control._machine.commit_job is None or not h.control._machine.commit_job.running)
            and h.control._machine.restore_job is None
        ),
        timeout=30,
    )


async def commit_resume_rounds(tmp_path: Path, rounds: int) -> dict[str, int]:
    h = await start_harness()
    seen: dict[str, int] = {}
    rng = random.Random(20261201)
    try:
        for episode, state in STATES.items():
            h.participant.seed(episode, state)
        span = 0.0
        for n in range(rounds + 1):
            checkpoint_id = f"c{n}"
            directory = tmp_path / checkpoint_id
            final = (await drain(h.client.prepare(checkpoint_id, h.deadline())))[-1]
            assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
            started = asyncio.get_running_loop().time()
            commit = asyncio.ensure_future(
                h.client.commit(checkpoint_id, h.deadline(), str(directory))
            )
            if n == 0:  # calibration: how long an undisturbed commit takes here, now
                await commit
                span = asyncio.get_running_loop().time() - started
                await h.client.resume(checkpoint_id, h.deadline())
                continue
            # Vary the interleaving (not a synchronization): the Resume lands anywhere from
            # before the export to after the publication.
            await asyncio.sleep(rng.uniform(0, 1.3 * span))
            resume = asyncio.ensure_future(h.client.resume(checkpoint_id, h.deadline()))
            result = await outcome(commit)
            assert result in ("ok", "STALE_CHECKPOINT"), (n, result)
            assert await outcome(resume) == "ok"
            seen[result] = seen.get(result, 0) + 1
            await settled(h)
            status = await h.client.get_status()
            assert status.admission_open and status.state == types_pb2.PARTICIPANT_STATE_IDLE
            part = directory.joinpath(*PART)
            names = set(os.listdir(part)) if part.exists() else set()
            if result == "ok":
                assert "manifest.json" in names, n
            if "manifest.json" in names:
                manifest, records = LocalStorage().read_part(
                    str(directory), "resources", "double", lambda record: True
                )
                assert manifest.record_count == len(STATES) == len(records)
                names.discard(manifest.records_file)
                names.discard("manifest.json")
            assert not names, (n, result, names)  # no litter once the writer ended
    finally:
        await stop_harness(h)
    return seen


async def restore_resume_rounds(tmp_path: Path, rounds: int) -> dict[str, int]:
    source = tmp_path / "source"
    maker = await start_harness()
    try:
        for episode, state in STATES.items():
            maker.participant.seed(episode, state)
        await drain(maker.client.prepare("c0", maker.deadline()))
        await maker.client.commit("c0", maker.deadline(), str(source))
    finally:
        await stop_harness(maker)
    seen: dict[str, int] = {}
    rng = random.Random(20261202)
    span = 0.0
    for n in range(rounds + 1):
        h = await start_harness(start_closed=rng.random() < 0.5)
        try:
            restore_id = f"restore-{n}"
            started = asyncio.get_running_loop().time()
            restore = asyncio.ensure_future(
                h.client.restore(restore_id, h.deadline(), str(source), list(STATES))
            )
            if n == 0:  # calibration, as for commits
                await restore
                span = asyncio.get_running_loop().time() - started
                continue
            await asyncio.sleep(rng.uniform(0, 1.3 * span))
            resume = asyncio.ensure_future(h.client.resume(restore_id, h.deadline()))
            result = await outcome(restore)
            assert result in ("ok", "STALE_CHECKPOINT"), (n, result)
            assert await outcome(resume) == "ok"
            seen[result] = seen.get(result, 0) + 1
            await settled(h)
            status = await h.client.get_status()
            assert status.admission_open and status.state == types_pb2.PARTICIPANT_STATE_IDLE
            if result == "ok":
                assert len(h.participant.states) == len(STATES)
            else:
                assert h.participant.states == {} and not h.participant.has_served()
        finally:
            await stop_harness(h)
    return seen


async def test_commit_and_resume_race_always_answers_typed(tmp_path: Path) -> None:
    seen = await commit_resume_rounds(tmp_path, rounds=25)
    assert sum(seen.values()) == 25


async def test_restore_and_resume_race_never_leaves_a_half_install(tmp_path: Path) -> None:
    seen = await restore_resume_rounds(tmp_path, rounds=15)
    assert sum(seen.values()) == 15


@pytest.mark.slow
async def test_many_commit_resume_rounds(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    only_when_asked_for(request)
    seen = await commit_resume_rounds(tmp_path, rounds=300)
    print("commit/resume outcomes over 300 rounds:", seen)


@pytest.mark.slow
async def test_many_restore_resume_rounds(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    only_when_asked_for(request)
    seen = await restore_resume_rounds(tmp_path, rounds=200)
    print("restore/resume outcomes over 200 rounds:", seen)
