"""The multi-worker participant's rules, in one process: a `WorkerPool` under a real control
plane and gRPC sidecar, its workers `WorkerBridge`s around test-double participants,
connected over a real Unix socket (the same bridge the worker processes use; see
tests/test_workers.py for the processes themselves).

Each upstream multi-worker behaviour has its test here: readiness merged and pushed, a late
joiner closed at once, records as one process writes them, restore into fewer workers, exactly
one claim and none while a checkpoint is open, retire reaching every worker with Forget
refused until every worker's retire finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.runtime.install import CheckpointRuntime
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.server.runtime.worker_bridge import WorkerBridge
from rollout_checkpoint.server.runtime.worker_pool import Placement, WorkerPool
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, refused
from .double import DoubleParticipant

PREPARED = types_pb2.PARTICIPANT_STATE_PREPARED
IN_FLIGHT = types_pb2.BLOCKER_REASON_REQUEST_IN_FLIGHT
WORKER_LOST = types_pb2.BLOCKER_REASON_WORKER_LOST
WAIT = 10.0


@dataclass
class Pool:
    pool: WorkerPool
    runtime: CheckpointRuntime
    client: ParticipantClient
    socket_path: str
    bridges: list[WorkerBridge]

    def worker(self, index: int) -> DoubleParticipant:
        participant = self.bridges[index].participant
        assert isinstance(participant, DoubleParticipant)
        return participant

    async def join(self, index: int) -> WorkerBridge:
        bridge = WorkerBridge(DoubleParticipant(), self.socket_path, index)
        await bridge.connect()
        await until(lambda: self.pool.workers.get(index) is not None, "the worker to register")
        if index < len(self.bridges):
            self.bridges[index] = bridge
        else:
            self.bridges.append(bridge)
        return bridge


async def until(predicate: Callable[[], Any], what: str) -> None:
    end = time.monotonic() + WAIT
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def pools() -> AsyncIterator[Callable[..., Any]]:
    started: list[Pool] = []
    private = tempfile.mkdtemp(prefix="rcw-")

    async def start(workers: int = 3, placement: Placement = Placement.SESSIONS) -> Pool:
        path = str(Path(private, f"b{len(started)}.sock"))
        pool = WorkerPool(Kind.RESOURCES, "double", workers, placement=placement)
        settings = CheckpointSettings(enabled=True, token=TOKEN, instance="double")
        runtime = CheckpointRuntime(ControlPlane(pool, settings.control_settings()), settings)
        await runtime.sidecar.start()
        server = await asyncio.start_unix_server(pool.serve_connection, path)
        handle = Pool(pool, runtime, ParticipantClient(runtime.address, TOKEN), path, [])
        handle.server = server  # type: ignore[attr-defined]
        started.append(handle)
        for index in range(workers):
            await handle.join(index)
        return handle

    try:
        yield start
    finally:
        for handle in started:
            for participant in (b.participant for b in handle.bridges):
                assert isinstance(participant, DoubleParticipant)
                for gate in participant.gates.values():
                    gate.set()
            for bridge in handle.bridges:
                await bridge.disconnect()
            await handle.client.close()
            handle.server.close()  # type: ignore[attr-defined]
            await handle.runtime.sidecar.stop(grace=0)
        shutil.rmtree(private, ignore_errors=True)


def deadline(seconds: float = WAIT) -> float:
    return time.time() + seconds


async def test_readiness_merges_every_worker_and_is_pushed_without_a_request(
    pools: Callable[..., Any],
) -> None:
    p = await pools()
    for index in range(3):
        p.worker(index).seed(EpisodeId(f"r{index}"), {"n": index})
    p.worker(2).seed(EpisodeId("r9"), {"n": 9})
    holding = contextlib.AsyncExitStack()
    await holding.enter_async_context(p.worker(1).request(EpisodeId("r1")))
    await until(lambda: p.pool.workers[1].state.counts.get("inflight") == 1, "the push")
    updates = []
    merged = None
    async for update in p.client.prepare("c1", deadline()):
        updates.append(update)
        # Until every worker reported this close, each one that did not is WORKER_MISSING;
        # then only worker 1's request blocks.
        blockers = [(b.capture_key, b.reason) for b in update.readiness.blockers]
        if merged is None and blockers == [("r1", IN_FLIGHT)]:
            merged = update
            assert not update.readiness.ready
            assert dict(update.readiness.counts) == {"inflight": 1, "sessions": 4, "workers": 3}
            assert all(not p.worker(i).admission for i in range(3))
            await holding.aclose()  # the request ends: the worker pushes, the stream follows
    assert merged is not None, updates
    assert updates[-1].final and updates[-1].state == PREPARED
    assert dict(updates[-1].readiness.counts) == {"inflight": 0, "sessions": 4, "workers": 3}


async def test_a_worker_joining_while_closed_closes_at_once_and_a_lost_one_blocks(
    pools: Callable[..., Any],
) -> None:
    p = await pools()
    assert (await p.client.prepare_until_final("c1", deadline())).state == PREPARED
    await p.bridges[2].disconnect()  # the worker dies while the checkpoint is open
    await until(lambda: 2 not in p.pool.workers, "the loss")
    late = await p.join(2)
    assert not p.worker(2).admission  # closed before it could take a request
    assert late.retired is not None
    status = await p.client.get_status()
    assert [b.reason for b in status.readiness.blockers] == [WORKER_LOST]
    await p.client.resume("c1", deadline())
    await until(lambda: p.worker(2).admission, "the reopen")
    assert (await p.client.prepare_until_final("c2", deadline())).state == PREPARED


async def test_commit_writes_the_records_one_process_writes_and_restores_into_fewer_workers(
    pools: Callable[..., Any], tmp_path: Path
) -> None:
    p = await pools()
    for index in range(3):
        p.worker(index).seed(EpisodeId(f"r{index}"), {"n": index})
    assert (await p.client.prepare_until_final("c1", deadline())).state == PREPARED
    committed = await p.client.commit("c1", deadline(), str(tmp_path))
    assert sorted(committed.exported) == ["r0", "r1", "r2"]
    part = tmp_path / "participants" / "resources" / "double"
    manifest = json.loads((part / "manifest.json").read_text())
    records = [json.loads(x) for x in (part / manifest["records_file"]).read_text().splitlines()]
    # Each worker's records as its participant exported them: nothing says where they were.
    assert records == [
        {"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "state": {"n": i}} for i in range(3)
    ]
    # Into two workers. A session goes where its id routes (tests/test_workers.py); these
    # records name no session, so they go to one worker, which installs them as they are.
    q = await pools(workers=2)
    scope = [EpisodeId(f"r{i}") for i in range(3)]
    restored = await q.client.restore("x1", deadline(), str(tmp_path), scope=scope)
    assert sorted(restored.restored) == ["r0-a1", "r1-a1", "r2-a1"]
    assert q.worker(0).states == {EpisodeId(f"r{i}", 1): {"n": i} for i in range(3)}
    assert q.worker(1).states == {}
    await until(lambda: len(q.pool.restored_pending()) == 3, "the pushes")
    # The crashed attempts are refused on every worker from the Resume on, also on the one
    # that got none of them.
    await q.client.resume("x1", deadline())
    await until(lambda: q.worker(1).admission, "the reopen")
    assert all(q.bridges[i].retired.is_retired(EpisodeId("r0", 0)) for i in range(2))


async def test_the_pool_decodes_the_workers_records_off_the_loop(
    pools: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full export decodes every worker's lines (JSON of the whole state): on the event
    loop it would stall the sidecar and every worker's bridge for the whole commit."""
    from rollout_checkpoint.server.runtime import worker_pool

    decoded_on: list[bool] = []
    decode = worker_pool.decoded_records

    def spy(lines: Any) -> Any:
        try:
            asyncio.get_running_loop()
            decoded_on.append(True)
        except RuntimeError:
            decoded_on.append(False)
        return decode(lines)

    monkeypatch.setattr(worker_pool, "decoded_records", spy)
    p = await pools(workers=2)
    for index in range(2):
        p.worker(index).seed(EpisodeId(f"r{index}"), {"n": index})
    assert (await p.client.prepare_until_final("c1", deadline())).state == PREPARED
    committed = await p.client.commit("c1", deadline(), str(tmp_path))
    assert sorted(committed.exported) == ["r0", "r1"]
    assert decoded_on == [False, False], "a worker's share was decoded on the event loop"


async def test_a_restored_record_is_claimed_exactly_once_and_never_while_closed(
    pools: Callable[..., Any], tmp_path: Path
) -> None:
    p = await pools(placement=Placement.CLAIMS)
    p.worker(1).seed(EpisodeId("r1"), {"n": 1})
    assert (await p.client.prepare_until_final("c1", deadline())).state == PREPARED
    await p.client.commit("c1", deadline(), str(tmp_path))
    q = await pools(placement=Placement.CLAIMS)
    await q.client.restore("x1", deadline(), str(tmp_path), scope=[EpisodeId("r1")])
    replacement = EpisodeId("r1", 1)
    with pytest.raises(CheckpointError) as caught:  # RESTORED: closed until Resume
        await q.bridges[0].claim(replacement)
    assert caught.value.metadata["code"] == "admission_closed"
    await q.client.resume("x1", deadline())
    claims = await asyncio.gather(*(bridge.claim(replacement) for bridge in q.bridges))
    won = [claim for claim in claims if claim is not None]
    assert len(won) == 1
    assert won[0].checkpointed == EpisodeId("r1") and won[0].fields == {"state": {"n": 1}}
    assert (await q.client.get_status()).restored_pending == 0


async def test_retire_reaches_every_worker_and_forget_waits_for_the_slowest(
    pools: Callable[..., Any],
) -> None:
    p = await pools()
    p.worker(0).seed(EpisodeId("r1"), {"n": 0})
    p.worker(1).seed(EpisodeId("r1", 0), {"n": 1})
    release = p.worker(1).gate("retire")
    await refused(
        p.client.retire("t1", deadline(0.5), [EpisodeId("r1")]), "CHECKPOINT_DEADLINE_EXCEEDED"
    )
    assert EpisodeId("r1") not in p.worker(0).states  # worker 0 freed its share
    await refused(p.client.forget("t1", deadline(), ["r1"]), "RETIRE_INCOMPLETE")
    release.set()
    await p.client.retire("t2", deadline(), [EpisodeId("r1")])
    assert all(p.bridges[i].retired.is_retired(EpisodeId("r1")) for i in range(3))
    assert EpisodeId("r1") not in p.worker(1).states
    await p.client.forget("t2", deadline(), ["r1"])
    assert not any(p.bridges[i].retired.is_retired(EpisodeId("r1")) for i in range(3))


async def test_a_restore_is_all_or_nothing_across_workers(
    pools: Callable[..., Any], tmp_path: Path
) -> None:
    p = await pools()
    for index in range(3):
        p.worker(index).seed(EpisodeId(f"r{index}"), {"n": index})
    assert (await p.client.prepare_until_final("c1", deadline())).state == PREPARED
    await p.client.commit("c1", deadline(), str(tmp_path))
    q = await pools()
    q.worker(1).fail["install"] = RuntimeError("worker 1 cannot install")
    scope = [EpisodeId(f"r{i}") for i in range(3)]
    await refused(q.client.restore("x1", deadline(), str(tmp_path), scope=scope), "HOOK_FAILED")
    # What the other workers installed was undone: nothing stays, the process stays fresh.
    assert all(q.worker(i).states == {} for i in range(3))
    await until(lambda: not q.pool.has_served(), "the workers' pushes")
    del q.worker(1).fail["install"]
    restored = await q.client.restore("x1", deadline(), str(tmp_path), scope=scope)
    assert sorted(restored.restored) == ["r0-a1", "r1-a1", "r2-a1"]
    # The double's records name no session: all on one worker (placement by session id:
    # tests/test_workers.py).
    assert [q.worker(i).states for i in range(3)] == [
        {EpisodeId(f"r{i}", 1): {"n": i} for i in range(3)},
        {},
        {},
    ]


async def test_a_survivor_with_several_workers_rejoins_a_restore(
    pools: Callable[..., Any], tmp_path: Path
) -> None:
    p = await pools()
    for index in range(3):
        p.worker(index).seed(EpisodeId(f"r{index}"), {"n": index})
    assert (await p.client.prepare_until_final("c1", deadline())).state == PREPARED
    await p.client.commit("c1", deadline(), str(tmp_path))
    await p.client.resume("c1", deadline())
    p.worker(0).seed(EpisodeId("r0"), {"n": 100})  # it went on after the checkpoint
    scope = [EpisodeId(f"r{i}") for i in range(3)]
    await refused(
        p.client.restore("x1", deadline(), str(tmp_path), scope=scope), "FRESH_PROCESS_REQUIRED"
    )
    restored = await p.client.restore("x2", deadline(), str(tmp_path), scope=scope, rejoin=True)
    assert sorted(restored.restored) == ["r0-a1", "r1-a1", "r2-a1"]
    assert p.worker(0).states[EpisodeId("r0", 1)] == {"n": 0}  # the checkpoint's, not 100
    assert EpisodeId("r0") not in p.worker(0).states  # the survivor's own was retired


async def test_a_worker_state_json_cannot_carry_fails_the_commit_naming_its_episode(
    pools: Callable[..., Any], tmp_path: Path
) -> None:
    p = await pools()
    p.worker(0).seed(EpisodeId("fine"), {"n": 2**80})  # a big integer survives the bridge
    p.worker(2).seed(EpisodeId("bad"), {"n": float("nan")})
    assert (await p.client.prepare_until_final("c1", deadline())).state == PREPARED
    error = await refused(p.client.commit("c1", deadline(), str(tmp_path)), "UNSERIALIZABLE_STATE")
    assert error.metadata["captureKey"] == "bad"
    assert not (tmp_path / "participants").exists()
    del p.worker(2).states[EpisodeId("bad")]
    await p.client.resume("c1", deadline())
    assert (await p.client.prepare_until_final("c2", deadline())).state == PREPARED
    await p.client.commit("c2", deadline(), str(tmp_path))
    part = tmp_path / "participants" / "resources" / "double"
    manifest = json.loads((part / "manifest.json").read_text())
    line = (part / manifest["records_file"]).read_text().splitlines()[0]
    stored = {"episode_id": {"rollout_id": "fine", "attempt": 0}, "state": {"n": 2**80}}
    assert line == json.dumps(stored, separators=(",", ":"))
