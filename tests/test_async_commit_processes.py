"""Asynchronous checkpoints across real processes: a member SIGKILLed during its background
write, and a storage failure after the fleet resumed.

The same servers as `test_process_crash` (a DoubleParticipant each, own ports, own process
group), whose storage stalls (after dropping a marker file) or fails with EIO while a flag
file of the test exists: "during the background write" is certain, not timing.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from grpc import aio

from rollout_checkpoint.client.checkpointing.checkpoint import Phase, checkpoint
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc
from rollout_checkpoint.v1 import participant_service_pb2 as pb

from .conftest import TOKEN
from .processes import announcement
from .processes import start as start_process
from .test_fleet_cli import CLI, cli, json_lines, real_fleet, stamp, start, stop
from .test_process_crash import SERVER, Server, Servers, fleet_of, open_again, seed, wait_marker
from .test_workers import (  # noqa: F401 - serve_workers is a fixture
    PREPARED,
    Served,
    deadline,
    part_records,
    post,
    seed_on_every_worker,
    serve_workers,
)

ASYNC_SERVER = SERVER.replace(
    """        super().__init__(crash_hook=lambda step: stall() if slow == "write" and step == "before_record" else None)""",
    """        super().__init__(crash_hook=self.step)

    def step(self, name):
        flags = Path(os.environ["MARKER_DIR"])
        if name == "before_record" and (flags / f"{instance}-stall").exists():
            (flags / f"{instance}-stall").unlink()
            stall()
        if name == "after_fsync" and (flags / f"{instance}-fail").exists():
            raise OSError(5, "input/output error")""",
)
assert ASYNC_SERVER != SERVER


class AsyncServers(Servers):
    """`Servers` running `ASYNC_SERVER`: storage governed by the flag files."""

    def start(self, *specs: tuple[str, str]) -> list[Server]:
        env = dict(
            os.environ,
            TOKEN=TOKEN,
            MARKER_DIR=str(self.markers),
            GRPC_VERBOSITY="ERROR",
            ROLLOUT_CHECKPOINT_LEASE_GRACE_SECONDS="1.0",
        )
        logs = [
            self.markers.parent / f"server-{len(self.logs) + i}-{n}.log"
            for i, (n, _) in enumerate(specs)
        ]
        self.logs += logs
        processes = [
            start_process([sys.executable, "-c", ASYNC_SERVER, name, "write"], env=env, log=log)
            for (name, _), log in zip(specs, logs, strict=True)
        ]
        self.processes += processes
        servers = []
        for (name, _), process, log in zip(specs, processes, logs, strict=True):
            announced = announcement(process, f"server {name}", log=log)
            server = Server(name, process, announced["http"], announced["grpc"])
            self.started.append(server)
            servers.append(server)
        return servers


@pytest.fixture
def servers(tmp_path: Path) -> Any:
    markers = tmp_path / "markers"
    markers.mkdir()
    started = AsyncServers(markers)
    try:
        yield started
    finally:
        started.close()


async def take(
    fleet: Any, root: CheckpointRoot, checkpoint_id: str, resumed: asyncio.Event | None = None
) -> Any:
    """One asynchronous checkpoint, published; `resumed` is set once the fleet was resumed
    (the await-parts phase begins after the Resume)."""
    events = []
    async for event in checkpoint(
        fleet, root, time.time() + 30, checkpoint_id=checkpoint_id, asynchronous=True
    ):
        events.append(event)
        if event.phase == Phase.AWAIT_PARTS and resumed is not None:
            resumed.set()
    outcome = events[-1].outcome
    assert outcome is not None and outcome.published is not None
    return outcome


async def test_a_member_killed_during_its_background_write(
    servers: AsyncServers, tmp_path: Path
) -> None:
    """The fleet is open again while the part is written; the kill fails that checkpoint
    only (nothing published, LATEST still the previous one); with a fresh process in the
    dead one's place the next asynchronous checkpoint publishes."""
    a, b = servers.start(("a", ""), ("b", ""))
    await asyncio.gather(seed(a, ["r1"]), seed(b, ["r2"]))
    root = CheckpointRoot(tmp_path / "published")
    async with fleet_of(a, b) as fleet:
        first = await take(fleet, root, "k0")
        assert root.latest() == "k0" and first.asynchronous
        (servers.markers / "a-stall").touch()
        resumed = asyncio.Event()
        running = asyncio.ensure_future(take(fleet, root, "k1", resumed))
        await wait_marker(servers, "a-write")
        # The write starts at a's snapshot, before the controller has resumed the fleet.
        await asyncio.wait_for(resumed.wait(), 30)
        # a's write is stuck in storage, and yet both members serve again.
        await open_again(a)
        await open_again(b)
        a.kill()
        with pytest.raises(FleetError) as caught:
            await running
        assert caught.value.operation == "await part"
        assert list(caught.value.failures) == ["a"]
    assert root.latest() == "k0"
    assert not (tmp_path / "published" / "k1" / "checkpoint.json").exists()
    assert not (
        tmp_path / "published" / "k1" / "participants" / "resources" / "a" / "manifest.json"
    ).exists()

    (fresh,) = servers.start(("a2", ""))
    await seed(fresh, ["r9"])
    async with fleet_of(fresh, b) as fleet:
        outcome = await take(fleet, root, "k2")
    assert root.latest() == "k2"
    exported = {name: list(reply.exported) for name, reply in outcome.commit.members.items()}
    assert exported == {"a2": ["r9"], "b": ["after", "r2"]}


async def test_a_storage_failure_after_the_resume_fails_only_that_checkpoint(
    servers: AsyncServers, tmp_path: Path
) -> None:
    a, b = servers.start(("a", ""), ("b", ""))
    await asyncio.gather(seed(a, ["r1"]), seed(b, ["r2"]))
    root = CheckpointRoot(tmp_path / "published")
    async with fleet_of(a, b) as fleet:
        await take(fleet, root, "k0")
        (servers.markers / "a-fail").touch()
        with pytest.raises(FleetError) as caught:
            await take(fleet, root, "k1")
        assert caught.value.operation == "await part"
        assert list(caught.value.failures) == ["a"]
        failure = caught.value.failures["a"]
        assert failure.reason == "STORAGE_FAILED" and "input/output" in failure.message
        assert root.latest() == "k0"
        assert not (tmp_path / "published" / "k1" / "checkpoint.json").exists()
        # The fleet keeps running, and once storage is back the next checkpoint goes ahead.
        await open_again(a)
        await open_again(b)
        (servers.markers / "a-fail").unlink()
        await take(fleet, root, "k2")
    assert root.latest() == "k2"


async def test_several_workers_snapshot_their_collected_export(
    serve_workers: Callable[..., Served],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """`serve counter --workers 3`: the snapshot is every worker's export collected into one
    part; the sessions move on after the resume, and the part still holds the cut."""
    checkpoint_dir = str(tmp_path / "ckpt")
    served = serve_workers("counter")
    sessions = await seed_on_every_worker(served.base_url)
    client = served.client
    final = await client.prepare_until_final("ckpt-1", deadline())
    assert final.state == PREPARED
    scope = [EpisodeId(rollout, 0) for rollout in sessions]
    snapshot = await client.commit(
        "ckpt-1", deadline(), checkpoint_dir, scope=scope, asynchronous=True
    )
    assert snapshot.snapshot_only and snapshot.snapshot_records == len(sessions)
    await client.resume("ckpt-1", deadline())
    for rollout, cookies in sessions.items():
        reply = await post(
            served.base_url, f"/ng-rollout/{rollout}/increment_counter", {"count": 5}, cookies
        )
        assert reply.status_code == 200, reply.text
    durable = await client.await_part("ckpt-1", deadline())
    assert durable.state == pb.PART_WRITE_STATE_DURABLE
    assert durable.manifest.bytes == snapshot.snapshot_bytes
    records = part_records(checkpoint_dir, "resources", "counter")
    assert sorted(r["episode_id"]["rollout_id"] for r in records) == sorted(sessions)
    for record in records:
        rollout = record["episode_id"]["rollout_id"]
        assert set(record) == {"episode_id", "session_id", "state"}  # as one process writes
        assert record["state"] == {"count": int(rollout[1:])}  # as seeded, before the resume
    await client.close()


async def test_the_coordinator_service_and_the_cli_take_asynchronous_checkpoints(
    tmp_path: Path,
) -> None:
    """CheckpointRequest.asynchronous: RESUME comes before AWAIT_PARTS and PUBLISH; the
    fleet file's `async_commit = true` makes the CLI's checkpoint asynchronous too."""
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with real_fleet(tmp_path) as fleet:
        httpx.post(fleet.http("counter") + "/ng-rollout/r1/seed_session", json={"initial_count": 2})
        coordinator = start([*CLI, "coordinator", "--fleet", str(fleet.fleet_file)])
        try:
            async with aio.insecure_channel(coordinator.announced["grpc"]) as channel:
                stub = cpb_grpc.CoordinatorServiceStub(channel)
                request = cpb.CheckpointRequest(
                    checkpoint_id="ckpt-a",
                    deadline=stamp(time.time() + 60),
                    derive_scope=True,
                    asynchronous=True,
                )
                messages = [
                    m async for m in stub.Checkpoint(request, metadata=metadata, timeout=60)
                ]
        finally:
            stop(coordinator)
        phases = [m.phase for m in messages if m.phase != cpb.CHECKPOINT_PHASE_PREPARE]
        assert phases == [
            cpb.CHECKPOINT_PHASE_COMMIT,
            cpb.CHECKPOINT_PHASE_RESUME,
            cpb.CHECKPOINT_PHASE_AWAIT_PARTS,
            cpb.CHECKPOINT_PHASE_PUBLISH,
            cpb.CHECKPOINT_PHASE_DONE,
        ]
        result = messages[-1].result
        assert result.published and result.record_count == 1
        assert result.HasField("durable_duration")
        assert (fleet.root / "LATEST").read_text().strip() == "ckpt-a"

        fleet.fleet_file.write_text("async_commit = true\n" + fleet.fleet_file.read_text())
        done = cli("checkpoint", "--fleet", str(fleet.fleet_file), "--json", "ckpt-b")
        assert done.returncode == 0, done.stderr
        lines = json_lines(done.stdout)
        assert [line["phase"] for line in lines if "phase" in line][-5:] == [
            "COMMIT",
            "RESUME",
            "AWAIT_PARTS",
            "PUBLISH",
            "DONE",
        ]
        assert lines[-1]["result"]["published"], lines[-1]
        assert (fleet.root / "LATEST").read_text().strip() == "ckpt-b"
