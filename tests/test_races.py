"""Races between a Commit or a Restore and the Resume that aborts it, many rounds each.

Each round sends both calls at one of three offsets: the Resume first by a hair, both in one
step (0 s: the Resume lands before the job started or right after), or the Resume after a
random delay of up to a little more than an undisturbed call takes, so it lands in every phase
of the other call (export, write, publication, read, install, done). Every offset also runs
beside a process spinning on one core, as on a loaded machine, where both calls' messages are
handled in the same loop turns. What must hold in every round, whatever the interleaving:

* both calls answer, typed: the Commit is COMMITTED or `STALE_CHECKPOINT`, the Restore is
  RESTORED or `STALE_CHECKPOINT`, the Resume succeeds (never INTERNAL, never no answer);
* admission is open afterwards and the participant is IDLE;
* a Commit that answered COMMITTED left a part that reads back whole; a part directory never
  holds a records file that no manifest names once its writer has ended;
* a Restore that answered STALE left nothing installed and the process fresh.

The deterministic tests below put the Resume exactly at the narrowest points: after the
call's join created its job, before the job ran a step; and as the export step ends.

The default size runs in the suite; `-m slow` runs the enlarged rounds reported in the issue's
closing note (issue 28 for the offsets before the job and the load).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.server.runtime import commit_job
from rollout_checkpoint.server.runtime.part_writes import PartSnapshot
from rollout_checkpoint.v1 import types_pb2

from .conftest import Harness, kill_group, prepared, start_harness, stop_harness
from .processes import start
from .test_load import only_when_asked_for

STATES = {EpisodeId(f"r{i}"): {"n": i, "pad": "x" * 200} for i in range(400)}
PART = ("participants", "resources", "double")

OFFSETS = ("resume-first", "together", "early", "in-phases")
"""When the Resume is sent: first by a hair, in the same step as the call, after a random
delay within the first fifth of an undisturbed call (around its join and its job's start),
or within the whole of it and a little past."""

SPIN_SECONDS = 300.0
"""Bound on the busy process's life should its finalizer never run (a killed test run)."""


async def outcome(call: Awaitable[object]) -> str:
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


@pytest.fixture
def load(request: pytest.FixtureRequest) -> Iterator[str]:
    """`LOADS`: "loaded" runs a process spinning on one core for the test's duration (killed
    at its end), as on a machine where other work competes for the cores."""
    if request.param != "loaded":
        yield request.param
        return
    spin = f"import time\nend = time.monotonic() + {SPIN_SECONDS}\nwhile time.monotonic() < end:\n    pass\n"
    spinner = start([sys.executable, "-c", spin])
    try:
        yield request.param
    finally:
        kill_group(spinner)


async def send_both(
    offset: str,
    call: Callable[[], Awaitable[Any]],
    resume: Callable[[], Awaitable[Any]],
    longest_delay: float,
    rng: random.Random,
) -> tuple[asyncio.Future[Any], asyncio.Future[Any]]:
    """Send the call and its Resume at `offset` (`OFFSETS`); returns both (call first).

    The delay of "in-phases" varies the interleaving; it is not a synchronization."""
    if offset == "resume-first":
        resumed = asyncio.ensure_future(resume())
        return asyncio.ensure_future(call()), resumed
    called = asyncio.ensure_future(call())
    if offset != "together":
        share = 0.2 / 1.3 if offset == "early" else 1.0
        await asyncio.sleep(rng.uniform(0, share * longest_delay))
    return called, asyncio.ensure_future(resume())


def label(result: str, succeeded: str) -> str:
    """The name a round's outcome is counted under (the call's result is ok or stale)."""
    return succeeded if result == "ok" else "stale"


async def commit_resume_rounds(tmp_path: Path, rounds: int) -> Counter[tuple[str, str]]:
    """`rounds` rounds at each offset; the outcomes counted per (offset, outcome)."""
    h = await start_harness()
    seen: Counter[tuple[str, str]] = Counter()
    rng = random.Random(20261201)
    try:
        for episode, state in STATES.items():
            h.participant.seed(episode, state)
        span = await undisturbed_commit(h, tmp_path / "calibration")
        for n in range(rounds * len(OFFSETS)):
            offset = OFFSETS[n % len(OFFSETS)]
            checkpoint_id = f"c{n}"
            directory = tmp_path / checkpoint_id
            await prepared(h, checkpoint_id)
            commit, resume = await send_both(
                offset,
                partial(h.client.commit, checkpoint_id, h.deadline(), str(directory)),
                partial(h.client.resume, checkpoint_id, h.deadline()),
                1.3 * span,
                rng,
            )
            result = await outcome(commit)
            assert result in ("ok", "STALE_CHECKPOINT"), (n, offset, result)
            assert await outcome(resume) == "ok", (n, offset)
            seen[(offset, label(result, "committed-then-resumed"))] += 1
            await settled(h)
            await check_open_and_no_litter(h, directory, result, (n, offset))
    finally:
        await stop_harness(h)
    return seen


async def undisturbed_commit(h: Harness, directory: Path) -> float:
    """How long an undisturbed commit takes here, now (the "in-phases" delays scale by it)."""
    await prepared(h, "calibration")
    started = asyncio.get_running_loop().time()
    await h.client.commit("calibration", h.deadline(), str(directory))
    span = asyncio.get_running_loop().time() - started
    await h.client.resume("calibration", h.deadline())
    return span


async def check_open_and_no_litter(
    h: Harness, directory: Path, result: str, where: tuple[int, str]
) -> None:
    """IDLE and open; a committed part reads back whole; nothing else in its directory."""
    status = await h.client.get_status()
    assert status.admission_open and status.state == types_pb2.PARTICIPANT_STATE_IDLE, where
    part = directory.joinpath(*PART)
    names = set(os.listdir(part)) if part.exists() else set()
    if result == "ok":
        assert "manifest.json" in names, where
    if "manifest.json" in names:
        manifest, records = LocalStorage().read_part(
            str(directory), "resources", "double", lambda record: True
        )
        assert manifest.record_count == len(STATES) == len(records), where
        names.discard(manifest.records_file)
        names.discard("manifest.json")
    assert not names, (where, result, names)  # no litter once the writer ended


async def commit_source(directory: Path) -> None:
    """A committed part of every `STATES` episode, for the restores to read."""
    maker = await start_harness()
    try:
        for episode, state in STATES.items():
            maker.participant.seed(episode, state)
        await prepared(maker, "c0")
        await maker.client.commit("c0", maker.deadline(), str(directory))
    finally:
        await stop_harness(maker)


async def restore_resume_rounds(tmp_path: Path, rounds: int) -> Counter[tuple[str, str]]:
    """`rounds` rounds at each offset, a fresh harness each; outcomes per (offset, outcome)."""
    source = tmp_path / "source"
    await commit_source(source)
    seen: Counter[tuple[str, str]] = Counter()
    rng = random.Random(20261202)
    span = await undisturbed_restore(source)
    for n in range(rounds * len(OFFSETS)):
        offset = OFFSETS[n % len(OFFSETS)]
        h = await start_harness(start_closed=rng.random() < 0.5)
        try:
            restore_id = f"restore-{n}"
            restore, resume = await send_both(
                offset,
                partial(h.client.restore, restore_id, h.deadline(), str(source), list(STATES)),
                partial(h.client.resume, restore_id, h.deadline()),
                1.3 * span,
                rng,
            )
            result = await outcome(restore)
            assert result in ("ok", "STALE_CHECKPOINT"), (n, offset, result)
            assert await outcome(resume) == "ok", (n, offset)
            seen[(offset, label(result, "restored-then-resumed"))] += 1
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


async def undisturbed_restore(source: Path) -> float:
    """How long an undisturbed restore takes here, now."""
    h = await start_harness()
    try:
        started = asyncio.get_running_loop().time()
        await h.client.restore("calibration", h.deadline(), str(source), list(STATES))
        return asyncio.get_running_loop().time() - started
    finally:
        await stop_harness(h)


def report(race: str, rounds: int, load: str, seen: Counter[tuple[str, str]]) -> None:
    for offset in OFFSETS:
        outcomes = {name: n for (at, name), n in sorted(seen.items()) if at == offset}
        print(f"{race} {load}, {rounds} rounds resume {offset}: {outcomes}")
    assert sum(seen.values()) == rounds * len(OFFSETS)


LOADS = ("unloaded", "loaded")
RACES = {"commit/resume": commit_resume_rounds, "restore/resume": restore_resume_rounds}


@pytest.mark.parametrize("load", LOADS, indirect=True)
async def test_commit_and_resume_race_always_answers_typed(tmp_path: Path, load: str) -> None:
    report("commit/resume", 12, load, await commit_resume_rounds(tmp_path, rounds=12))


async def test_restore_and_resume_race_never_leaves_a_half_install(tmp_path: Path) -> None:
    report("restore/resume", 4, "unloaded", await restore_resume_rounds(tmp_path, rounds=4))


@pytest.mark.slow
@pytest.mark.parametrize("load", LOADS, indirect=True)
@pytest.mark.parametrize(("race", "rounds"), [("commit/resume", 100), ("restore/resume", 50)])
async def test_many_rounds(
    tmp_path: Path, request: pytest.FixtureRequest, load: str, race: str, rounds: int
) -> None:
    only_when_asked_for(request)
    report(race, rounds, load, await RACES[race](tmp_path, rounds))


# -- the Resume at the narrowest points, deterministically -------------------------------------


class HeldAfterDirectoryCheck:
    """Holds the control plane's next Commit or Restore once its directory is checked, just
    before it takes the lock to join (or start) its job.

    `let_go_then_resume` lets it go and, in the same step, starts a Resume on the control
    plane: both run in the next loop turn, the call's join first (its job's task created,
    not yet run), then the Resume, before the job's first step."""

    def __init__(self, control: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.control = control
        self.checked = asyncio.Event()
        self._release = asyncio.Event()
        check_directory = control._validated_dir

        async def checked_then_held(checkpoint_dir: str, deadline: float) -> str:
            real_dir: str = await check_directory(checkpoint_dir, deadline)
            self.checked.set()
            await self._release.wait()
            return real_dir

        monkeypatch.setattr(control, "_validated_dir", checked_then_held)

    async def let_go_then_resume(self, checkpoint_id: str, deadline: float) -> bool:
        await self.checked.wait()
        self._release.set()
        # Scheduled in this very step, right behind the call's wake-up (not at the await).
        resume = asyncio.ensure_future(self.control.resume(checkpoint_id, deadline))
        idempotent: bool = await resume
        return idempotent


@pytest.fixture
async def seeded() -> AsyncIterator[Harness]:
    h = await start_harness()
    try:
        for episode, state in STATES.items():
            h.participant.seed(episode, state)
        yield h
    finally:
        await stop_harness(h)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["synchronous", "asynchronous"])
async def test_a_resume_before_the_commit_job_ran_answers_the_commit_stale(
    seeded: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """Issue 28: the Resume cancelled the job's task before its first step, the task ended
    cancelled without translating it, and the Commit answered INTERNAL_ERROR."""
    h = seeded
    await prepared(h)
    held = HeldAfterDirectoryCheck(h.control, monkeypatch)
    directory = tmp_path / "c1"
    commit = asyncio.ensure_future(
        h.client.commit("c1", h.deadline(), str(directory), asynchronous=asynchronous)
    )
    assert await held.let_go_then_resume("c1", h.deadline()) is False
    assert await outcome(commit) == "STALE_CHECKPOINT"
    await settled(h)
    await check_open_and_no_litter(h, directory, "STALE_CHECKPOINT", (1, "before-the-job"))
    assert h.participant.export_calls == 0  # the stopped job never exported
    assert not directory.exists() and h.control.part_writes.get("c1") is None


@pytest.mark.parametrize("rejoin", [False, True], ids=["fresh", "rejoin"])
async def test_a_resume_before_the_restore_job_ran_answers_the_restore_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rejoin: bool
) -> None:
    """The same point for a Restore: its job is abandoned, never cancelled, and fails typed
    at its first transition; nothing is installed and a fresh process stays fresh."""
    source = tmp_path / "source"
    await commit_source(source)
    h = await start_harness()
    try:
        if rejoin:
            h.participant.seed(EpisodeId("live"), {"n": -1})
        held = HeldAfterDirectoryCheck(h.control, monkeypatch)
        restore = asyncio.ensure_future(
            h.client.restore("r1", h.deadline(), str(source), list(STATES), rejoin=rejoin)
        )
        assert await held.let_go_then_resume("r1", h.deadline()) is False
        assert await outcome(restore) == "STALE_CHECKPOINT"
        await settled(h)
        status = await h.client.get_status()
        assert status.admission_open and status.state == types_pb2.PARTICIPANT_STATE_IDLE
        assert not h.participant.installed
        assert h.participant.has_served() is rejoin  # a rejoin abandoned before its discard
    finally:
        await stop_harness(h)


async def test_a_resume_as_the_snapshot_ends_keeps_the_asynchronous_commit_from_writing(
    seeded: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Resume lands once the snapshot step ended, before the job went on: there is no
    step left to cancel, and the job must still not clean up, release, or start a background
    write of the abandoned checkpoint."""
    h = seeded
    await prepared(h)
    taken, release = asyncio.Event(), asyncio.Event()
    take_snapshot = commit_job._snapshot

    async def taken_then_held(*arguments: Any) -> PartSnapshot:
        snapshot = await take_snapshot(*arguments)
        taken.set()
        await release.wait()
        return snapshot

    monkeypatch.setattr(commit_job, "_snapshot", taken_then_held)
    directory = tmp_path / "c1"
    commit = asyncio.ensure_future(
        h.client.commit("c1", h.deadline(), str(directory), asynchronous=True)
    )
    await taken.wait()
    release.set()  # the snapshot step ends in the next loop turn, the Resume runs right after
    resume = asyncio.ensure_future(h.control.resume("c1", h.deadline()))
    assert await resume is False
    assert await outcome(commit) == "STALE_CHECKPOINT"
    await settled(h)
    await check_open_and_no_litter(h, directory, "STALE_CHECKPOINT", (1, "snapshot-end"))
    assert h.control.part_writes.get("c1") is None and not directory.exists()
