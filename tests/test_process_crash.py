"""A participant process SIGKILLed in the middle of a fleet checkpoint or restore.

Real processes (a DoubleParticipant server each, its own HTTP and gRPC ports, its own process
group), driven by the coordination library exactly as a controller drives them. A member is
killed while PREPARED, while its commit is writing, and while its restore is reading: the
library names it (FleetError, PARTICIPANT_UNREACHABLE), the other members are resumed by the
controller's abort (or, with no controller left, reopen when their short lease expires), no
fleet checkpoint is published and nothing is left installed, and a later checkpoint or
restore of a fleet with a fresh process in the dead one's place succeeds.

The write and the read are slowed down by the server script (a sleep in the storage, after it
drops a marker file), so "while committing" and "while restoring" are certain, not timing.
Each server's control plane runs on a clock that stands still until the test moves it
(POST /test/clock), so a lease expires when the test says, never because the machine is slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import checkpoint
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN
from .processes import announcement, kill_group
from .processes import start as start_process

LEASE_GRACE = 1.0
IDLE = types_pb2.PARTICIPANT_STATE_IDLE

SERVER = r"""
import json, os, sys, threading, time
from pathlib import Path

import uvicorn

from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_checkpoint.server.core.clock import ManualClock
from rollout_checkpoint.server.runtime.install import install_checkpointing
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence
from tests.double import DoubleParticipant, create_app

instance, slow = sys.argv[1], sys.argv[2]  # slow: "", "write" or "read"
marker = Path(os.environ["MARKER_DIR"]) / f"{instance}-{slow}"


def stall():
    marker.touch()
    time.sleep(120)


class SlowStorage(LocalStorage):
    def __init__(self):
        super().__init__(crash_hook=lambda step: stall() if slow == "write" and step == "before_record" else None)

    def read_part(self, *args, **kwargs):
        if slow == "read":
            stall()
        return super().read_part(*args, **kwargs)


participant = DoubleParticipant(instance)
app = create_app(participant)
clock = ManualClock(time.time())  # stands still until the test moves it


async def set_clock(request):
    clock.set((await request.json())["now"])
    return JSONResponse({"now": clock.now()})


app.router.routes.append(Route("/test/clock", set_clock, methods=["POST"]))
settings = CheckpointSettings(enabled=True, token=os.environ["TOKEN"])  # lease from the env
runtime = install_checkpointing(app, participant, settings, storage=SlowStorage(), clock=clock)


class Announcing(uvicorn.Server):
    async def startup(self, sockets=None):
        await super().startup(sockets)
        port = self.servers[0].sockets[0].getsockname()[1]
        print(json.dumps({"http": f"127.0.0.1:{port}", "grpc": runtime.address}), flush=True)


Announcing(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")).run()
"""


@dataclass
class Server:
    name: str
    process: subprocess.Popen[str]
    http: str
    grpc: str

    def kill(self) -> None:
        kill_group(self.process)


class Servers:
    """Starts servers (several at once: their imports overlap) and kills them all at the end."""

    def __init__(self, markers: Path) -> None:
        self.markers = markers
        self.started: list[Server] = []
        self.processes: list[subprocess.Popen[str]] = []
        self.logs: list[Path] = []

    def start(self, *specs: tuple[str, str]) -> list[Server]:
        env = dict(
            os.environ,
            TOKEN=TOKEN,
            MARKER_DIR=str(self.markers),
            GRPC_VERBOSITY="ERROR",
            ROLLOUT_CHECKPOINT_LEASE_GRACE_SECONDS=str(LEASE_GRACE),
        )
        logs = [
            self.markers.parent / f"server-{len(self.logs) + i}-{name}.log"
            for i, (name, _) in enumerate(specs)
        ]
        self.logs += logs
        processes = [
            start_process([sys.executable, "-c", SERVER, name, slow], env=env, log=log)
            for (name, slow), log in zip(specs, logs, strict=True)
        ]
        self.processes += processes
        servers = []
        for (name, _), process, log in zip(specs, processes, logs, strict=True):
            announced = announcement(process, f"server {name}", log=log)
            server = Server(name, process, announced["http"], announced["grpc"])
            self.started.append(server)
            servers.append(server)
        return servers

    def close(self) -> None:
        for process in self.processes:  # also those that never announced
            kill_group(process)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    markers = tmp_path / "markers"
    markers.mkdir()
    started = Servers(markers)
    try:
        yield started
    finally:
        started.close()


@contextlib.asynccontextmanager
async def fleet_of(*members: Server) -> AsyncIterator[Fleet]:
    spec = FleetSpec(members=tuple(MemberSpec(m.name, m.grpc) for m in members), token=TOKEN)
    fleet = await Fleet.discover(spec)
    try:
        yield fleet
    finally:
        await fleet.close()


async def seed(server: Server, rollouts: list[str]) -> None:
    async with httpx.AsyncClient(base_url=f"http://{server.http}", timeout=10) as http:
        for rollout in rollouts:
            response = await http.post(
                f"/ng-rollout/{rollout}/seed", json={"state": {"r": rollout}}
            )
            assert response.status_code == 200, response.text


async def status(server: Server) -> Any:
    async with ParticipantClient(server.grpc, TOKEN) as client:
        return await client.get_status()


async def set_clock(server: Server, now: float) -> None:
    """Move the server's control-plane clock to `now` (it stands still otherwise)."""
    async with httpx.AsyncClient(base_url=f"http://{server.http}", timeout=30) as http:
        response = await http.post("/test/clock", json={"now": now})
        assert response.status_code == 200, response.text


async def open_again(server: Server) -> None:
    """The member is IDLE with admission open, and its data plane takes requests again."""
    reply = await status(server)
    assert reply.state == IDLE and reply.admission_open, reply
    await seed(server, ["after"])


async def wait_marker(servers: Servers, name: str, timeout: float = 30) -> None:
    path = servers.markers / name
    async with asyncio.timeout(timeout):
        while not path.exists():  # noqa: ASYNC110 - a file written by another process
            await asyncio.sleep(0.02)


def assert_unreachable(error: FleetError, member: str, operation: str) -> None:
    assert error.operation == operation
    assert list(error.failures) == [member], error.failures
    assert error.reason == "PARTICIPANT_UNREACHABLE"
    assert not error.failures[member].decided_by_server
    assert member in str(error)


async def test_a_member_killed_while_prepared(servers: Servers, tmp_path: Path) -> None:
    """The commit names the dead member; with no controller left to resume it, the survivor
    reopens when its lease expires; a fresh fleet then checkpoints and publishes."""
    a, b = servers.start(("a", ""), ("b", ""))
    await asyncio.gather(seed(a, ["r1", "r2"]), seed(b, ["r3"]))
    deadline = time.time() + 600  # never reached on b's clock but when the test moves it
    async with fleet_of(a, b) as fleet:
        progress = await fanout.prepare_until_done(fleet, "k1", deadline)
        assert progress.prepared
        a.kill()
        with pytest.raises(FleetError) as caught:
            await fanout.commit(fleet, "k1", deadline, str(tmp_path / "k1"), None)
        assert_unreachable(caught.value, "a", "commit")
    # The controller gives up too (no Resume). b's clock has not moved, so no timer of b can
    # have fired: it is closed, holding a lease of deadline + grace...
    held = await status(b)
    assert not held.admission_open
    assert held.lease_expires_at.ToSeconds() == int(deadline + LEASE_GRACE)
    # ...and once its clock passes that lease, b reopens on its own.
    await set_clock(b, deadline + LEASE_GRACE + 0.001)
    async with asyncio.timeout(30):
        while not (await status(b)).admission_open:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.05)
    await open_again(b)

    (fresh,) = servers.start(("a2", ""))
    await seed(fresh, ["r9"])
    root = CheckpointRoot(tmp_path / "published")
    async with fleet_of(fresh, b) as fleet:  # a deadline ahead of b's clock too
        events = [e async for e in checkpoint(fleet, root, deadline + 60)]
    outcome = events[-1].outcome
    assert outcome is not None and outcome.published is not None and outcome.commit is not None
    exported = {name: list(reply.exported) for name, reply in outcome.commit.members.items()}
    assert exported == {"a2": ["r9"], "b": ["after", "r3"]}
    summary = await asyncio.to_thread(root.inspect)
    assert summary.manifest.checkpoint_id == outcome.checkpoint_id


async def test_a_member_killed_while_its_commit_writes(servers: Servers, tmp_path: Path) -> None:
    """The controller's checkpoint fails naming the member, aborts (the survivor is resumed
    at once), publishes nothing; a fresh fleet's checkpoint then publishes."""
    a, b = servers.start(("a", "write"), ("b", ""))
    await asyncio.gather(seed(a, ["r1"]), seed(b, ["r2"]))
    root = CheckpointRoot(tmp_path / "published")
    async with fleet_of(a, b) as fleet:

        async def run() -> list[Any]:
            return [e async for e in checkpoint(fleet, root, time.time() + 30, checkpoint_id="k1")]

        running = asyncio.ensure_future(run())
        await wait_marker(servers, "a-write")
        a.kill()
        with pytest.raises(FleetError) as caught:
            await running
        assert_unreachable(caught.value, "a", "commit")
    await open_again(b)  # resumed by the abort, well before its lease
    assert root.latest() is None  # nothing published
    part = tmp_path / "published" / "k1" / "participants" / "resources" / "a"
    assert not (part / "manifest.json").exists()

    (fresh,) = servers.start(("a2", ""))
    await seed(fresh, ["r9"])
    async with fleet_of(fresh, b) as fleet:
        events = [e async for e in checkpoint(fleet, root, time.time() + 30)]
    outcome = events[-1].outcome
    assert outcome is not None and outcome.published is not None and outcome.commit is not None
    assert root.latest() == outcome.checkpoint_id
    exported = {name: list(reply.exported) for name, reply in outcome.commit.members.items()}
    assert exported == {"a2": ["r9"], "b": ["after", "r2"]}


def write_part(directory: Path, instance: str, rollouts: list[str]) -> None:
    lines = [
        json.dumps(
            {"episode_id": EpisodeId(r).to_json(), "state": {"r": r}}, separators=(",", ":")
        ).encode()
        for r in rollouts
    ]
    LocalStorage().write_part(str(directory), "resources", instance, "k1", lines, WriteFence())


async def test_a_member_killed_while_it_restores(servers: Servers, tmp_path: Path) -> None:
    """The restore is all or nothing: the survivor's installed episodes are retired and it is
    resumed, the dead member is named; fresh processes then restore the same checkpoint."""
    directory = tmp_path / "k1"
    write_part(directory, "a", ["r1"])
    write_part(directory, "b", ["r2", "r3"])
    scope = [EpisodeId("r1"), EpisodeId("r2"), EpisodeId("r3")]
    a, b = servers.start(("a", "read"), ("b", ""))
    async with fleet_of(a, b) as fleet:
        running = asyncio.ensure_future(
            fanout.restore(fleet, "restore-1", time.time() + 30, str(directory), scope)
        )
        await wait_marker(servers, "a-read")
        a.kill()
        with pytest.raises(FleetError) as caught:
            await running
        assert_unreachable(caught.value, "a", "restore")
        # b installed its part, then the cleanup retired those attempts and resumed it.
        reply = await status(b)
        assert reply.state == IDLE and reply.admission_open and reply.restored_pending == 0
        assert reply.readiness.counts["sessions"] == 0
        assert reply.retired_rollouts == 3

    a2, b2 = servers.start(("a", ""), ("b", ""))
    async with fleet_of(a2, b2) as fleet:
        replies = await fanout.restore(fleet, "restore-2", time.time() + 30, str(directory), scope)
        assert {n: list(r.restored) for n, r in replies.items()} == {
            "a": ["r1-a1"],
            "b": ["r2-a1", "r3-a1"],
        }
        await fanout.resume(fleet, "restore-2", time.time() + 30)
    async with httpx.AsyncClient(base_url=f"http://{b2.http}", timeout=10) as http:
        state = await http.get("/ng-rollout/r2-a1/state")
        assert state.json() == {"state": {"r": "r2"}}
