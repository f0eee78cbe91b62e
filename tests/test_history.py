"""The checkpoint history: every checkpoint and restore attempted leaves a record in the root,
which a new process (`rollout-checkpoint history`) reads back, on disk and on an object store;
bounded, atomic, and never a failure of the checkpoint it describes."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.checkpointing import recording
from rollout_checkpoint.client.checkpointing.checkpoint import (
    CheckpointOutcome,
    checkpoint,
    restore_published,
)
from rollout_checkpoint.client.checkpointing.fanout import (
    FleetError,
    FleetProgress,
    MemberProgress,
    Outcome,
)
from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointRoot,
    PublicationRoot,
    open_checkpoint_root,
)
from rollout_checkpoint.client.checkpointing.publication.history import (
    CORRUPT_INDEX_NAME,
    DETAILS_KEPT,
    INDEX_NAME,
    HistoryEntry,
    Trigger,
    details_name,
    open_history,
)
from rollout_checkpoint.client.coordinator.supervisor import RestartStrategy, SupervisorSettings
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.v1 import types_pb2

from .s3_server import S3Connection, SeaweedS3
from .test_coordination import RunningFleet, fleet_of
from .test_fleet_cli import CLI, ENV
from .test_supervisor import (  # noqa: F401 - counters is a fixture
    CounterFleet,
    Events,
    counters,
    supervising,
)

KINDS = (Kind.AGENT, Kind.RESOURCES)


async def take(
    f: RunningFleet, root: PublicationRoot, checkpoint_id: str, **options: Any
) -> CheckpointOutcome:
    outcome = None
    options.setdefault("deadline", f.deadline())
    async for event in checkpoint(
        f.fleet, root, checkpoint_id=checkpoint_id, scope=None, **options
    ):
        outcome = event.outcome or outcome
    assert outcome is not None
    return outcome


async def take_failing(f: RunningFleet, root: PublicationRoot, checkpoint_id: str) -> None:
    """A checkpoint the resources member refuses at its commit (its export hook fails)."""
    f.h["resources"].participant.fail["export"] = RuntimeError("disk on fire")
    with pytest.raises(FleetError):
        await take(f, root, checkpoint_id)
    del f.h["resources"].participant.fail["export"]


def seed(f: RunningFleet) -> None:
    for harness in f.h.values():
        harness.participant.seed(EpisodeId("r1"), {"n": 1})


def history_cli(root: str, *flags: str, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [*CLI, "history", "--root", root, *flags],
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def entries_of(root: str, *flags: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    done = history_cli(root, "--json", *flags, env=env)
    assert done.returncode == 0, done.stderr
    entries: list[dict[str, Any]] = json.loads(done.stdout)["entries"]
    return entries


async def take_and_restore(root_location: str) -> None:
    """Two completed checkpoints (one periodic and asynchronous), one a member refuses, then a
    restore into fresh processes."""
    root = open_checkpoint_root(root_location)
    async with fleet_of(*KINDS) as f:
        seed(f)
        await take(f, root, "ckpt-one")
        await take(f, root, "ckpt-two", trigger=Trigger.PERIODIC, asynchronous=True)
        await take_failing(f, root, "ckpt-three")
    async with fleet_of(*KINDS) as fresh:
        await restore_published(fresh.fleet, root, "restore-one", fresh.deadline())


def check_read_back(entries: Sequence[dict[str, Any]]) -> None:
    assert [(e["id"], e["operation"], e["status"]) for e in entries] == [
        ("restore-one", "restore", "completed"),
        ("ckpt-three", "checkpoint", "failed"),
        ("ckpt-two", "checkpoint", "completed"),
        ("ckpt-one", "checkpoint", "completed"),
    ]
    restore, failed, periodic, manual = entries
    assert (restore["source"], restore["members"], restore["continued"]) == ("ckpt-two", 2, 1)
    assert (failed["reason"], failed["failed_members"]) == ("PARTICIPANT_FAILED", ["resources"])
    assert "resources: HOOK_FAILED" in failed["message"]
    assert (periodic["trigger"], periodic["mode"]) == ("periodic", "async")
    assert (manual["trigger"], manual["mode"]) == ("manual", "sync")
    assert manual["records"] == 2 and manual["bytes"] > 0
    assert [s["stage"] for s in manual["stages"]] == [
        "prepare",
        "commit",
        "publish",
        "resume",
        "retention",
    ]
    assert [s["stage"] for s in periodic["stages"]] == [
        "prepare",
        "snapshot",
        "resume",
        "durable",
        "publish",
        "retention",
    ]
    assert manual["duration_seconds"] >= sum(s["seconds"] for s in manual["stages"]) - 1e-3


async def test_a_new_process_reads_every_attempt_back_from_a_local_root(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    await take_and_restore(root)
    entries = entries_of(root)
    check_read_back(entries)
    members = open_history(root).members(HistoryEntry.from_json(entries[1]))
    assert [(m.name, m.error) for m in members] == [("agent", ""), ("resources", "HOOK_FAILED")]
    assert all(m.prepared_seconds is not None for m in members)
    completed = open_history(root).members(HistoryEntry.from_json(entries[3]))
    assert [m.records for m in completed] == [1, 1]
    assert completed[0].part == f"{root}/ckpt-one/participants/agent/agent"

    assert [e["id"] for e in entries_of(root, "--failed")] == ["ckpt-three"]
    assert [e["id"] for e in entries_of(root, "--limit", "1")] == ["restore-one"]
    table = history_cli(root)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["STARTED", "ID", "OPERATION"]
    assert "ckpt-three" in lines[2] and "PARTICIPANT_FAILED (resources)" in lines[2]


async def test_a_new_process_reads_every_attempt_back_from_an_object_store(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection: S3Connection = s3_server.connection
    for name, value in connection.environment().items():
        monkeypatch.setenv(name, value)
    url = connection.url(f"history-{secrets.token_hex(6)}")
    await take_and_restore(url)
    check_read_back(entries_of(url, env=dict(ENV, **connection.environment())))


def attempt_cli(root: str, attempt_id: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """`history --id --json` of one attempt in a new process: its entry, its members by name."""
    done = history_cli(root, "--id", attempt_id, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    return document["entry"], {m["name"]: m for m in document["members"]}


def stage_seconds(entry: dict[str, Any], *stages: str) -> float:
    """How long `stages` of an attempt took together (1 ms for rounding and two clocks)."""
    return sum(s["seconds"] for s in entry["stages"] if s["stage"] in stages) + 1e-3


async def test_each_member_s_commit_durable_part_and_restore_are_timed(tmp_path: Path) -> None:
    location = str(tmp_path / "root")
    root = CheckpointRoot(tmp_path / "root")
    async with fleet_of(*KINDS) as f:
        seed(f)
        await take(f, root, "ckpt-sync")
        await take(f, root, "ckpt-async", asynchronous=True)
        await take_failing(f, root, "ckpt-refused")
    async with fleet_of(*KINDS) as fresh:
        await restore_published(fresh.fleet, root, "restore-timed", fresh.deadline())

    entry, members = attempt_cli(location, "ckpt-sync")
    assert sorted(members) == ["agent", "resources"]
    for member in members.values():
        assert 0 < member["commit_seconds"] <= stage_seconds(entry, "commit")
        assert member["commit_seconds"] <= entry["duration_seconds"]
        assert member["durable_seconds"] is None and member["restore_seconds"] is None

    entry, members = attempt_cli(location, "ckpt-async")
    for member in members.values():
        assert 0 < member["commit_seconds"] <= stage_seconds(entry, "snapshot")
        assert member["commit_seconds"] <= member["durable_seconds"]
        assert member["durable_seconds"] <= stage_seconds(entry, "snapshot", "resume", "durable")

    _, members = attempt_cli(location, "ckpt-refused")
    assert members["resources"]["error"] == "HOOK_FAILED"
    assert members["resources"]["commit_seconds"] is None  # it never replied
    assert members["agent"]["commit_seconds"] > 0

    entry, members = attempt_cli(location, "restore-timed")
    assert sorted(members) == ["agent", "resources"]
    for member in members.values():
        assert 0 < member["restore_seconds"] <= entry["duration_seconds"]
        assert member["commit_seconds"] is None

    table = history_cli(location, "--id", "ckpt-async")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("MEMBER")))
    assert lines[header].split()[4:7] == ["COMMIT", "DURABLE", "RESTORE"]
    agent = lines[header + 1].split()
    assert agent[0] == "agent" and agent[4].endswith("s") and agent[6] == "-"
    missing = history_cli(location, "--id", "ckpt-never")
    assert missing.returncode == 2 and "no attempt 'ckpt-never'" in missing.stderr


async def test_the_prepare_s_snapshots_are_read_after_the_resume_a_bounded_batch_at_a_time(
    tmp_path: Path,
) -> None:
    """The recorder reads no member while the fleet is paused (a short prepare's snapshots
    wait for the record), holds at most `WATCH_BATCH` of a long prepare's unread, and reads
    every snapshot in order either way."""
    root = CheckpointRoot(tmp_path / "root")
    snapshots = 2 * recording.WATCH_BATCH + 1
    prepared_at = {"resources": recording.WATCH_BATCH + 3, "agent": snapshots}
    async with fleet_of(*KINDS) as f:
        recorder = recording.CheckpointRecorder(
            f.fleet, root, "ckpt-long", f.deadline(), "manual", asynchronous=False
        )
        blocked = types_pb2.ReadinessReport(blocker_count=2)
        entries = {
            m.name: MemberProgress(m.name, m.kind, reached=True, readiness=blocked)
            for m in f.fleet.members
        }
        for sequence in range(1, snapshots + 1):
            for name, at in prepared_at.items():
                if sequence == at:
                    entries[name] = MemberProgress(
                        name,
                        entries[name].kind,
                        reached=True,
                        state=types_pb2.PARTICIPANT_STATE_PREPARED,
                    )
            members = [entries[m.name] for m in f.fleet.members]
            recorder.observe(
                "PREPARE", FleetProgress(Kind.AGENT, members, sequence, sequence / 100)
            )
            if sequence < recording.WATCH_BATCH:
                assert recorder._watch == {}  # nothing read while the fleet is paused
            assert len(recorder._unread) < recording.WATCH_BATCH
        await recorder.finished(CheckpointOutcome("ckpt-long", Outcome.PREPARED))
    (recorded,) = entries_of(str(tmp_path / "root"))
    members = {
        m.name: m for m in open_history(root.location).members(HistoryEntry.from_json(recorded))
    }
    for name, at in prepared_at.items():
        assert members[name].prepared_seconds == at / 100
        assert members[name].blocked_seconds == pytest.approx((at - 1) / 100)
        assert members[name].blockers_max == 2


def entry(number: int, **fields: Any) -> HistoryEntry:
    values: dict[str, Any] = {
        "id": f"ckpt-{number}",
        "operation": "checkpoint",
        "trigger": "manual",
        "mode": "sync",
        "status": "completed",
        "started_at": "2026-01-01T00:00:00.000000Z",
        "ended_at": "2026-01-01T00:00:01.000000Z",
        "duration_seconds": 1.0,
    }
    return HistoryEntry(**(values | fields))


def test_the_size_cap_drops_the_oldest_entries(tmp_path: Path) -> None:
    history = open_history(tmp_path)
    cap = 10 * len(json.dumps(entry(0).to_json()))
    for number in range(30):
        history.append(entry(number), [], max_bytes=cap)
    kept = [e.id for e in history.read().entries]
    assert 8 <= len(kept) < 30
    assert kept == [f"ckpt-{n}" for n in range(30 - len(kept), 30)]
    assert (tmp_path / INDEX_NAME).stat().st_size <= cap


def test_only_the_newest_attempts_keep_their_details_files(tmp_path: Path) -> None:
    history = open_history(tmp_path)
    member = recording.MemberRecord("m", "resources", "m")
    for number in range(DETAILS_KEPT + 3):
        history.append(entry(number, details=details_name(f"ckpt-{number}")), [member])
    entries = history.read().entries
    assert len(entries) == DETAILS_KEPT + 3
    assert [e.details for e in entries[:3]] == ["", "", ""]
    assert history.members(entries[-1]) == (member,)
    details = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".history-"))
    assert len(details) == DETAILS_KEPT


def write_concurrently(location: str, writers: int = 4, each: int = 5) -> None:
    history = open_history(location)

    def write(writer: int) -> None:
        for number in range(each):
            history.append(entry(writer * 100 + number), [])

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(history.read().entries) == writers * each


def test_concurrent_writers_of_a_local_root_lose_no_entry(tmp_path: Path) -> None:
    write_concurrently(str(tmp_path))


def test_concurrent_writers_of_an_object_store_root_lose_no_entry(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each writer replaces the index by compare-and-swap and appends again when it lost."""
    connection: S3Connection = s3_server.connection
    for name, value in connection.environment().items():
        monkeypatch.setenv(name, value)
    write_concurrently(connection.url(f"history-writers-{secrets.token_hex(6)}"))


async def test_a_corrupt_history_is_reported_and_the_next_checkpoint_starts_a_fresh_one(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / INDEX_NAME).write_bytes(b'{"format": 1, "entries": [{"id": 7}]}')
    done = history_cli(str(root))
    assert done.returncode == 6
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1
    assert INDEX_NAME in done.stderr and "history skipped" in done.stderr
    async with fleet_of(*KINDS) as f:
        seed(f)
        outcome = await take(f, CheckpointRoot(root), "ckpt-after")
    assert outcome.published is not None
    assert [e["id"] for e in entries_of(str(root))] == ["ckpt-after"]
    assert (root / CORRUPT_INDEX_NAME).read_bytes() == b'{"format": 1, "entries": [{"id": 7}]}'


def test_an_index_naming_a_path_as_details_is_corrupt_and_nothing_outside_is_touched(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    hostile = entry(1, details="../victim.json").to_json()
    (root / INDEX_NAME).write_text(json.dumps({"format": 1, "entries": [hostile]}))
    problem = open_history(root).read().problem
    assert problem is not None and "is not a details object's name" in problem
    for number in range(DETAILS_KEPT + 2):
        open_history(root).append(entry(number), [], max_bytes=1000)
    assert victim.read_text() == "{}"


async def test_a_newer_format_is_refused_clearly_and_never_overwritten(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    newer = b'{"format": 2, "entries": []}'
    (root / INDEX_NAME).write_bytes(newer)
    done = history_cli(str(root))
    assert done.returncode == 6 and "history format 2" in done.stderr
    async with fleet_of(*KINDS) as f:
        seed(f)
        outcome = await take(f, CheckpointRoot(root), "ckpt-newer")
    assert outcome.published is not None
    assert (root / INDEX_NAME).read_bytes() == newer


async def test_a_history_that_cannot_be_written_does_not_fail_the_checkpoint(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    (root / INDEX_NAME).mkdir(parents=True)  # not a file: every write of the index fails
    failed_before = recording.WRITES.failed
    async with fleet_of(*KINDS) as f:
        seed(f)
        outcome = await take(f, CheckpointRoot(root), "ckpt-unrecorded")
        await take_failing(f, CheckpointRoot(root), "ckpt-failed-unrecorded")
    assert outcome.published is not None
    assert CheckpointRoot(root).latest() == "ckpt-unrecorded"
    assert recording.WRITES.failed == failed_before + 2
    done = history_cli(str(root))
    assert done.returncode == 6 and "not a regular file" in done.stderr


def test_a_missing_root_is_one_line_and_a_usage_error(tmp_path: Path) -> None:
    done = history_cli(str(tmp_path / "nowhere"))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert "no such checkpoint root" in done.stderr
    empty = history_cli(str(tmp_path))
    assert empty.returncode == 0 and "no checkpoint history yet" in empty.stdout


async def test_a_fleet_not_prepared_is_recorded_aborted_naming_the_blocked_member(
    tmp_path: Path,
) -> None:
    root = CheckpointRoot(tmp_path / "root")
    async with fleet_of(*KINDS) as f:
        agent = f.h["agent"].participant
        agent.seed(EpisodeId("r1"), {})
        async with agent.request(EpisodeId("r1")):  # in flight: the agent cannot prepare
            taking = asyncio.ensure_future(take(f, root, "ckpt-blocked", deadline=f.deadline(5)))
            await f.h["agent"].until(lambda: f.h["agent"].control.state == "PREPARING")
            f.advance(6)
            outcome = await taking
    assert outcome.published is None
    (recorded,) = entries_of(str(tmp_path / "root"))
    assert (recorded["status"], recorded["reason"]) == ("aborted", "NOT_PREPARED")
    assert recorded["failed_members"] == ["agent"]
    members = open_history(root.location).members(HistoryEntry.from_json(recorded))
    blocked = {m.name: m for m in members}["agent"]
    assert (blocked.blockers_max, blocked.prepared_seconds, blocked.error) == (
        1,
        None,
        "NOT_PREPARED",
    )


async def test_an_interrupted_checkpoint_is_recorded_aborted(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path / "root")
    async with fleet_of(*KINDS) as f:
        seed(f)
        resources = f.h["resources"].participant
        release = resources.gate("export")  # the commit hangs in the export hook
        taking = asyncio.ensure_future(take(f, root, "ckpt-interrupted"))
        await resources.entered["export"].wait()
        taking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taking
        release.set()
    # The record is written on a daemon thread (a cancelled task awaits no store): join it.
    for thread in threading.enumerate():
        if thread.name.startswith("history: "):
            thread.join(timeout=60)
    (recorded,) = entries_of(str(tmp_path / "root"))
    assert (recorded["status"], recorded["reason"]) == ("aborted", "INTERRUPTED")


async def test_the_supervisor_records_its_periodic_checkpoints_and_its_recoveries(
    counters: CounterFleet,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    for name in ("c0", "c1"):
        counters.start(name)
    root = tmp_path / "checkpoints"
    spec = counters.spec(root)
    settings = SupervisorSettings(
        checkpoint_every=0.2,
        recovery_seconds=20.0,
        strategy=RestartStrategy(max_tries=3, backoff_seconds=0.2),
    )
    async with supervising(spec, settings) as coordinator:
        assert coordinator.port is not None
        async with Events(coordinator.port) as events:
            published = await events.wait_for("checkpoint_published")
            counters.replace("c1")
            finished = await events.wait_for("recovery_finished")
    entries = entries_of(str(root))
    by_id = {e["id"]: e for e in entries}
    assert by_id[published.checkpoint_id]["trigger"] == "periodic"
    assert by_id[published.checkpoint_id]["status"] == "completed"
    recovery = by_id[finished.recovery_id]
    assert (recovery["operation"], recovery["trigger"], recovery["status"]) == (
        "restore",
        "supervisor",
        "completed",
    )
    assert recovery["source"] == finished.source_checkpoint_id and recovery["members"] == 2
    _, members = attempt_cli(str(root), finished.recovery_id)
    assert sorted(members) == ["c0", "c1"]
    assert all(m["restore_seconds"] > 0 for m in members.values()), members


async def test_a_cli_checkpoint_that_fails_at_its_deadline_is_recorded(tmp_path: Path) -> None:
    """The record of an attempt that ended at its deadline is written on a daemon thread
    past it; the CLI waits a little for it before it exits (before, the thread died with
    the process and the failure, the attempt an operator looks for, left no record)."""
    from .test_history_api import write_fleet_file

    root = tmp_path / "root"
    async with fleet_of(Kind.AGENT, Kind.RESOURCES) as f:
        seed(f)
        fleet_file = write_fleet_file(tmp_path, f, root)
        command = [*CLI, "checkpoint", "--fleet", str(fleet_file), "--timeout", "3", "ckpt-late"]
        release = f.h["resources"].participant.gate("export")  # its commit outlives the deadline
        try:
            run = await asyncio.to_thread(
                subprocess.run, command, env=ENV, capture_output=True, text=True, timeout=120
            )
        finally:
            release.set()
        assert run.returncode != 0, run.stdout
    entries = entries_of(str(root))
    assert [(e["id"], e["status"]) for e in entries] == [("ckpt-late", "failed")], run.stderr
