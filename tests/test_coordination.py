"""Fleet coordination over real participants (doubles of every kind, each with its sidecar)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import checkpoint
from rollout_checkpoint.client.checkpointing.fanout import DERIVE, FleetError, Outcome
from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot, PublishedCheckpoint
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import (
    DEFAULT_FAN_OUT,
    DiscoveryError,
    Fleet,
    FleetSpec,
    MemberSpec,
    load_fleet_file,
)
from rollout_checkpoint.server.core.clock import ManualClock
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, Harness, start_harness, stop_harness
from .double import DoubleParticipant

KINDS = [Kind.RESOURCES, Kind.AGENT, Kind.ENVIRONMENT, Kind.MODEL]


class LoggingDouble(DoubleParticipant):
    """A double that writes its admission changes into a log shared by the fleet."""

    def __init__(self, name: str, kind: Kind, log: list[str]) -> None:
        super().__init__(name, kind)
        self.log = log

    def close_admission(self) -> None:
        super().close_admission()
        self.log.append(f"close {self.instance}")

    def open_admission(self) -> None:
        super().open_admission()
        self.log.append(f"open {self.instance}")


class RunningFleet:
    def __init__(
        self, harnesses: dict[str, Harness], fleet: Fleet, log: list[str], clock: ManualClock
    ) -> None:
        self.h = harnesses
        self.fleet = fleet
        self.log = log
        self.clock = clock

    def deadline(self, seconds: float = 60) -> float:
        return self.clock.now() + seconds

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)


@contextlib.asynccontextmanager
async def fleet_of(*kinds: Kind, fan_out: int = DEFAULT_FAN_OUT) -> AsyncIterator[RunningFleet]:
    """One member per kind given, named after its kind (`<kind><i>` when a kind repeats)."""
    log: list[str] = []
    clock = ManualClock()
    harnesses: dict[str, Harness] = {}
    try:
        for index, kind in enumerate(kinds):
            name = kind.value if kinds.count(kind) == 1 else f"{kind.value}{index}"
            harnesses[name] = await start_harness(
                participant=LoggingDouble(name, kind, log), clock=clock
            )
        spec = FleetSpec(
            members=tuple(MemberSpec(n, h.grpc_address) for n, h in harnesses.items()),
            token=TOKEN,
            allow_agents_without_model=True,
            fan_out=fan_out,
        )
        fleet = await Fleet.discover(spec)
        for member in fleet.members:
            member.client._clock = clock.now
        try:
            yield RunningFleet(harnesses, fleet, log, clock)
        finally:
            await fleet.close()
    finally:
        for harness in harnesses.values():
            await stop_harness(harness)


async def test_prepare_closes_stages_in_order_and_resume_reopens_in_reverse() -> None:
    async with fleet_of(*KINDS) as f:
        assert [m.name for m in f.fleet.members] == ["environment", "model", "agent", "resources"]
        snapshots = [s async for s in fanout.prepare(f.fleet, "c1", f.deadline())]
        final = snapshots[-1]
        assert final.outcome == Outcome.PREPARED and final.prepared
        assert all(m.state == types_pb2.PARTICIPANT_STATE_PREPARED for m in final.members)
        assert [s.sequence for s in snapshots] == list(range(1, len(snapshots) + 1))
        assert f.log == ["close environment", "close model", "close agent", "close resources"]
        await fanout.resume(f.fleet, "c1", f.deadline())
        assert f.log[4:] == ["open resources", "open agent", "open model", "open environment"]


async def test_a_stage_larger_than_the_fan_out_bound_is_prepared_and_resumed_whole() -> None:
    # fan_out=1: a Prepare stream frees its slot at its first update and stays open, so
    # the next member's Prepare starts while the first is still being watched.
    async with fleet_of(*[Kind.RESOURCES] * 3, Kind.ENVIRONMENT, fan_out=1) as f:
        final = await fanout.prepare_until_done(f.fleet, "c1", f.deadline())
        assert final.prepared and all(m.done for m in final.members)
        assert sorted(f.log) == sorted(f"close {m.name}" for m in f.fleet.members)
        await fanout.resume(f.fleet, "c1", f.deadline())
        assert len(f.log) == 8


async def test_progress_snapshots_are_spaced_by_the_interval_and_the_outcome_never_waits() -> None:
    # fan_out=1: the members answer one after another, so every update arrives on its own.
    async with fleet_of(*[Kind.RESOURCES] * 8, fan_out=1) as f:
        each = [s async for s in fanout.prepare(f.fleet, "c1", f.deadline(), progress_interval=0)]
        assert len(each) >= 8, "without an interval, every member's update is a snapshot"
        await fanout.resume(f.fleet, "c1", f.deadline())

        started = time.monotonic()
        spaced = [
            s async for s in fanout.prepare(f.fleet, "c2", f.deadline(), progress_interval=600)
        ]
        assert time.monotonic() - started < 60, "the stage's end waited for the interval"
        assert [s.outcome for s in spaced] == [None, Outcome.PREPARED]
        assert [s.sequence for s in spaced] == [1, 2]
        assert all(m.state == types_pb2.PARTICIPANT_STATE_PREPARED for m in spaced[-1].members)
        await fanout.resume(f.fleet, "c2", f.deadline())


async def test_fan_out_calls_at_most_its_limit_at_once_and_collects_every_failure() -> None:
    running = 0
    most = 0

    async def call(member: Any) -> str:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        if member.name.endswith("7"):
            raise ControlError(grpc.StatusCode.UNAVAILABLE, "down")
        return member.name

    members: list[Any] = [types.SimpleNamespace(name=f"m{i}") for i in range(20)]
    with pytest.raises(FleetError) as refused:
        await fanout.fan_out("probe", members, call, 4)
    assert most == 4 and set(refused.value.failures) == {"m7", "m17"}
    replies = await fanout.fan_out("probe", members[:7], call, 3)
    assert list(replies) == [f"m{i}" for i in range(7)] and most == 4


async def test_an_unready_stage_stops_prepare_there() -> None:
    async with fleet_of(*KINDS) as f:
        agent = f.h["agent"].participant
        agent.seed(EpisodeId("r1"), {})
        in_flight = contextlib.AsyncExitStack()
        await in_flight.enter_async_context(agent.request(EpisodeId("r1")))
        deadline = f.deadline(5)
        snapshots: list[Any] = []

        async def run() -> None:
            async for snapshot in fanout.prepare(f.fleet, "c1", deadline):
                snapshots.append(snapshot)

        task = asyncio.ensure_future(run())
        await f.h["agent"].until(lambda: f.h["agent"].control.state == "PREPARING")
        f.advance(6)
        await task
        final = snapshots[-1]
        assert (
            final.outcome == Outcome.NOT_PREPARED
            and final.stage == types_pb2.PARTICIPANT_KIND_AGENT
        )
        assert [(m, b.capture_key) for m, b in final.blockers()] == [("agent", "r1")]
        assert final.blocking_episodes() == {EpisodeId("r1")}
        resources = next(m for m in final.members if m.name == "resources")
        assert not resources.reached
        assert "close resources" not in f.log
        assert f.h["resources"].participant.admission  # never touched
        with pytest.raises(FleetError) as refused:
            await fanout.retire(f.fleet, "x", f.deadline(), [EpisodeId("r1")])
        assert refused.value.reason == "PARTICIPANT_FAILED"
        assert refused.value.failures["environment"].reason == "INVALID_PHASE"
        await fanout.resume(f.fleet, "c1", f.deadline())
        await in_flight.aclose()
        await fanout.retire(f.fleet, "x", f.deadline(), [EpisodeId("r1")])
        assert (await fanout.prepare_until_done(f.fleet, "c2", f.deadline())).prepared


async def test_resume_after_a_partial_prepare_fences_members_never_reached() -> None:
    async with fleet_of(Kind.MODEL, Kind.RESOURCES) as f:
        model = f.h["model"].participant
        model.seed(EpisodeId("r1"), {})
        in_flight = contextlib.AsyncExitStack()
        await in_flight.enter_async_context(model.request(EpisodeId("r1")))
        task = asyncio.ensure_future(fanout.prepare_until_done(f.fleet, "c1", f.deadline(5)))
        await f.h["model"].until(lambda: f.h["model"].control.state == "PREPARING")
        f.advance(6)
        assert (await task).outcome == Outcome.NOT_PREPARED
        replies = await fanout.resume(f.fleet, "c1", f.deadline())
        assert replies["resources"].idempotent and not replies["model"].idempotent
        late = f.h["resources"].client.prepare("c1", f.deadline())
        from .conftest import drain, refused

        await refused(drain(late), "STALE_CHECKPOINT")
        await in_flight.aclose()


async def test_commit_scopes_every_member_and_renew_extends_every_lease(tmp_path: Path) -> None:
    async with fleet_of(Kind.AGENT, Kind.RESOURCES, Kind.MODEL) as f:
        for harness in f.h.values():
            for rollout in ("r1", "r2", "r3"):
                harness.participant.seed(EpisodeId(rollout), {"at": harness.participant.instance})
        assert (await fanout.prepare_until_done(f.fleet, "c1", f.deadline(10))).prepared
        before = {
            n: (await h.client.get_status()).lease_expires_at.ToSeconds() for n, h in f.h.items()
        }
        earliest = await fanout.renew(f.fleet, "c1", f.deadline(100))
        assert earliest == pytest.approx(f.deadline(100) + 600, abs=1)
        after = {
            n: (await h.client.get_status()).lease_expires_at.ToSeconds() for n, h in f.h.items()
        }
        assert all(after[n] > before[n] for n in f.h)
        result = await fanout.commit(
            f.fleet, "c1", f.deadline(), str(tmp_path / "c1"), [EpisodeId("r1"), EpisodeId("r3")]
        )
        assert {n: list(r.exported) for n, r in result.members.items()} == {
            n: ["r1", "r3"] for n in f.h
        }
        assert result.record_count() == 6
        await fanout.resume(f.fleet, "c1", f.deadline())
        assert (await fanout.prepare_until_done(f.fleet, "c2", f.deadline())).prepared
        derived = await fanout.commit(f.fleet, "c2", f.deadline(), str(tmp_path / "c2"), DERIVE)
        assert derived.scope == {EpisodeId("r1"), EpisodeId("r2"), EpisodeId("r3")}
        assert all(list(r.exported) == ["r1", "r2", "r3"] for r in derived.members.values())


class RetentionLoggingRoot(CheckpointRoot):
    """A checkpoint root that writes into the fleet's admission log when retention runs."""

    def __init__(self, path: Path, log: list[str]) -> None:
        super().__init__(path)
        self.log = log

    def complete_retention(self, published: PublishedCheckpoint) -> PublishedCheckpoint:
        self.log.append(f"retention {published.checkpoint_id}")
        return super().complete_retention(published)


async def test_retention_deletes_the_previous_checkpoint_only_once_every_member_is_open_again(
    tmp_path: Path,
) -> None:
    """Deleting a whole checkpoint is no part of the fleet's pause: retention runs after the
    last Resume, and the outcome says how long the fleet was closed and what was deleted."""
    async with fleet_of(Kind.ENVIRONMENT, Kind.AGENT, Kind.RESOURCES) as f:
        for harness in f.h.values():
            harness.participant.seed(EpisodeId("r1"), {"n": 1})
        root = RetentionLoggingRoot(tmp_path / "root", f.log)
        outcomes = []
        for checkpoint_id in ("ckpt-first", "ckpt-second"):
            f.log.clear()
            async for event in checkpoint(
                f.fleet, root, f.deadline(), checkpoint_id=checkpoint_id, scope=None, keep=1
            ):
                if event.final:
                    outcomes.append(event.outcome)
        first, second = outcomes
        assert first is not None and second is not None
        assert f.log[-1] == "retention ckpt-second"
        assert sorted(f.log[-4:-1]) == [f"open {name}" for name in sorted(f.h)]
        assert second.published is not None and second.published.deleted == ("ckpt-first",)
        assert second.published.pending_retention is None
        assert root.published() == ["ckpt-second"]
        assert second.resumed_seconds is not None
        assert second.resumed_seconds >= second.prepare_seconds + second.commit_seconds


async def make_fleet_checkpoint(f: RunningFleet, directory: str, episodes: list[EpisodeId]) -> None:
    for harness in f.h.values():
        for episode in episodes:
            harness.participant.seed(episode, {"n": 1})
    assert (await fanout.prepare_until_done(f.fleet, "c1", f.deadline())).prepared
    await fanout.commit(f.fleet, "c1", f.deadline(), directory, episodes)


async def test_restore_is_all_or_nothing(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    episodes = [EpisodeId("r1"), EpisodeId("r2", 2)]
    async with fleet_of(Kind.AGENT, Kind.RESOURCES) as old:
        await make_fleet_checkpoint(old, directory, episodes)
    async with fleet_of(Kind.AGENT, Kind.RESOURCES) as f:
        f.h["resources"].participant.fail["install"] = RuntimeError("disk on fire")
        with pytest.raises(FleetError) as failed:
            await fanout.restore(f.fleet, "restore-1", f.deadline(), directory, episodes)
        assert list(failed.value.failures) == ["resources"]
        assert failed.value.failures["resources"].reason == "HOOK_FAILED"
        for name, harness in f.h.items():
            status = await harness.client.get_status()
            assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open, name
            assert harness.participant.states == {}, name  # nothing live anywhere
            assert status.retired_rollouts == 2, name
            marks = harness.control.retired_attempts
            assert (marks.highest("r1"), marks.highest("r2")) == (1, 3), name


async def test_restore_cleanup_goes_on_when_a_retire_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = str(tmp_path / "ckpt")
    episodes = [EpisodeId("r1")]
    async with fleet_of(Kind.AGENT, Kind.RESOURCES) as old:
        await make_fleet_checkpoint(old, directory, episodes)
    async with fleet_of(Kind.AGENT, Kind.RESOURCES) as f:
        f.h["resources"].participant.fail["install"] = RuntimeError("broken")
        f.h["agent"].participant.fail["retire"] = RuntimeError("retire broken too")
        with pytest.raises(FleetError) as failed:
            await fanout.restore(f.fleet, "restore-1", f.deadline(), directory, episodes)
        assert list(failed.value.failures) == ["resources"]
        for name, harness in f.h.items():
            status = await harness.client.get_status()
            assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open, name
            assert harness.control.retired_attempts.highest("r1") == 1, name
    # The cleanup's own failure is logged once (what failed, and why going on is safe); the
    # caller gets the restore's failure.
    logged = [
        r for r in caplog.records if r.name == "rollout_checkpoint.client.checkpointing.fanout"
    ]
    assert len(logged) == 1 and logged[0].levelname == "WARNING", logged
    message = logged[0].getMessage()
    assert "restore-1" in message and "retire failed on 1 member(s): agent" in message
    assert "nothing will continue those attempts" in message


async def test_restore_succeeds_everywhere(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    episodes = [EpisodeId("r1")]
    async with fleet_of(Kind.AGENT, Kind.RESOURCES) as old:
        await make_fleet_checkpoint(old, directory, episodes)
    async with fleet_of(Kind.AGENT, Kind.RESOURCES) as f:
        replies = await fanout.restore(f.fleet, "restore-1", f.deadline(), directory, episodes)
        assert {n: list(r.restored) for n, r in replies.items()} == {
            "agent": ["r1-a1"],
            "resources": ["r1-a1"],
        }
        await fanout.resume(f.fleet, "restore-1", f.deadline())
        assert all(h.participant.admission for h in f.h.values())


async def test_retire_and_forget_go_callers_before_callees() -> None:
    async with fleet_of(*KINDS) as f:
        order: list[str] = []
        for name, harness in f.h.items():
            original = harness.participant.retire

            async def recording(
                episode: EpisodeId, name: str = name, original: Any = original
            ) -> None:
                order.append(name)
                await original(episode)

            harness.participant.retire = recording
        await fanout.retire(f.fleet, "x", f.deadline(), [EpisodeId("r1")])
        assert order[:2] == ["environment", "agent"] and sorted(order[2:]) == ["model", "resources"]
        await fanout.forget(f.fleet, "x", f.deadline(), ["r1"])
        assert all(h.control.retired_attempts.highest("r1") is None for h in f.h.values())


async def test_discovery_names_a_member_that_is_down() -> None:
    # A port bound but not listening refuses connections, and stays ours for the whole test
    # (a port closed again could be taken by another server meanwhile).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
        harness = await start_harness()
        try:
            spec = FleetSpec(
                members=(MemberSpec("alive", harness.grpc_address), MemberSpec("dead", dead)),
                token=TOKEN,
            )
            # A refused connection fails a try at once; the generous try timeout is only so
            # that the live member always answers in time, however loaded the machine.
            async with asyncio.timeout(120):
                with pytest.raises(DiscoveryError) as failed:
                    await Fleet.discover(spec, tries=2, try_timeout=30, backoff=0.01)
            assert list(failed.value.failures) == ["dead"]
            wrong_token = FleetSpec(
                members=(MemberSpec("alive", harness.grpc_address),), token="wrong"
            )
            with pytest.raises(DiscoveryError, match="TOKEN_INVALID"):
                await Fleet.discover(wrong_token)
        finally:
            await stop_harness(harness)


async def test_agents_without_a_model_are_refused_unless_allowed() -> None:
    async with fleet_of(Kind.AGENT) as f:
        refusing = FleetSpec(members=f.fleet.spec.members, token=TOKEN)
        with pytest.raises(DiscoveryError, match="no policy model"):
            await Fleet.discover(refusing)
        fleet = await Fleet.discover(f.fleet.spec)
        await fleet.close()


async def test_straggler_policy_retires_blockers_and_prepares_again() -> None:
    async with fleet_of(Kind.RESOURCES) as f:
        participant = f.h["resources"].participant
        participant.seed(EpisodeId("slow"), {})
        in_flight = contextlib.AsyncExitStack()
        await in_flight.enter_async_context(participant.request(EpisodeId("slow")))
        ids = iter(["s1", "s2", "s3"])

        async def release_when_retired() -> None:
            await f.h["resources"].until(
                lambda: f.h["resources"].control.retired_attempts.highest("slow") == 0
            )
            await in_flight.aclose()  # the retire stops the straggler's request

        releaser = asyncio.ensure_future(release_when_retired())
        deadlines = iter([f.deadline(5)] + [f.deadline(60)] * 10)

        def advance_on_first(progress: Any) -> None:
            if (
                progress.sequence == 1
                and progress.members[0].state == types_pb2.PARTICIPANT_STATE_PREPARING
            ):
                f.advance(6)

        result = await fanout.prepare_retiring_stragglers(
            f.fleet,
            lambda: next(ids),
            lambda: next(deadlines),
            rounds=2,
            on_progress=advance_on_first,
        )
        await releaser
        assert result.progress.prepared and result.checkpoint_id == "s2"
        assert result.retired == [EpisodeId("slow")] and result.rounds == 1


def test_fleet_files(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text(
        'checkpoint_root = "ckpts"\nkeep = 3\n[[participants]]\nname = "a"\naddress = "127.0.0.1:1"\n'
    )
    spec = load_fleet_file(toml, environ={"ROLLOUT_CHECKPOINT_TOKEN": "t"})
    assert spec.members == (MemberSpec("a", "127.0.0.1:1"),) and spec.keep == 3
    assert spec.fan_out == DEFAULT_FAN_OUT == 64
    assert spec.checkpoint_root == str(tmp_path / "ckpts") and spec.token == "t"
    yaml_file = tmp_path / "fleet.yaml"
    (tmp_path / "token").write_text("from-file\n")
    yaml_file.write_text(
        "token_file: token\nfan_out: 8\nparticipants:\n  - {name: b, address: '127.0.0.1:2'}\n"
    )
    assert load_fleet_file(yaml_file, environ={}).token == "from-file"
    assert load_fleet_file(yaml_file, environ={}).fan_out == 8
    from rollout_checkpoint.client.fleet import FleetConfigError

    for bad in (
        "participants: []\n",
        "nonsense: 1\nparticipants: [{name: a, address: x}]\n",
        "participants: [{name: '../x', address: x}]\n",
        "fan_out: 0\nparticipants: [{name: a, address: x}]\n",
        "fan_out: many\nparticipants: [{name: a, address: x}]\n",
    ):
        yaml_file.write_text(bad)
        with pytest.raises(FleetConfigError):
            load_fleet_file(yaml_file, environ={"ROLLOUT_CHECKPOINT_TOKEN": "t"})
    yaml_file.write_text("participants: [{name: a, address: x}]\n")
    with pytest.raises(FleetConfigError, match="no token"):
        load_fleet_file(yaml_file, environ={})
