"""Asynchronous commits through the real RPCs: snapshot, resume, background write, AwaitPart."""

from __future__ import annotations

import asyncio
import errno
import json

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.server.runtime.participant import ExportRecord
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

from .conftest import prepared, refused, start_harness, stop_harness
from .test_commit import GatedStorage, part_dir, records_of, wait_thread_event


async def test_async_commit_reopens_before_the_write_and_stores_the_snapshot(
    checkpoint_dir: str,
) -> None:
    storage = GatedStorage("before_record")
    h = await start_harness(storage=storage)
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        h.participant.seed(EpisodeId("r2"), {"n": 1})

        async def aliasing_export(scope: object) -> list[ExportRecord]:
            # Records that alias the live state: only a snapshot of bytes taken before the
            # reply keeps what the data plane does after the resume out of the part.
            return [ExportRecord(e, {"state": s}) for e, s in h.participant.states.items()]

        h.participant.export = aliasing_export  # type: ignore[method-assign,assignment]
        await prepared(h)
        reply = await h.client.commit("c1", h.deadline(), checkpoint_dir, asynchronous=True)
        assert reply.state == types_pb2.PARTICIPANT_STATE_COMMITTED
        assert reply.snapshot_only and not reply.HasField("manifest")
        assert reply.snapshot_records == 2 and reply.snapshot_bytes > 0
        assert list(reply.exported) == ["r1", "r2"]
        await wait_thread_event(storage.reached)
        # The write is held in storage: the fleet reopens anyway, and the write goes on.
        resumed = await h.client.resume("c1", h.deadline())
        assert not resumed.idempotent
        assert (await h.client.get_status()).admission_open
        assert storage.fence is not None and not storage.fence.stopped
        writing = await h.client.await_part("c1")
        assert writing.state == pb.PART_WRITE_STATE_WRITING
        # State changed after the snapshot (in place) never reaches the part.
        # (The write is held before its first record; the second is the one it has not read.)
        h.participant.states[EpisodeId("r2")]["n"] = 2
        storage.release.set()
        durable = await h.client.await_part("c1", h.deadline())
        assert durable.state == pb.PART_WRITE_STATE_DURABLE
        assert durable.manifest.record_count == 2
        assert durable.manifest.bytes == reply.snapshot_bytes
        manifest_bytes = (part_dir(checkpoint_dir) / "manifest.json").read_bytes()
        import hashlib

        assert durable.manifest_sha256 == hashlib.sha256(manifest_bytes).hexdigest()
        assert json.loads(manifest_bytes)["checkpoint_id"] == "c1"
        assert records_of(checkpoint_dir) == [
            '{"episode_id":{"rollout_id":"r1","attempt":0},"state":{"n":1}}',
            '{"episode_id":{"rollout_id":"r2","attempt":0},"state":{"n":1}}',
        ]
        assert (await h.client.await_part("c-other")).state == pb.PART_WRITE_STATE_UNKNOWN
    finally:
        storage.release.set()
        await stop_harness(h)


async def test_a_second_commit_waits_for_the_running_background_write(
    checkpoint_dir: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    storage = GatedStorage("before_record")
    h = await start_harness(storage=storage)
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await prepared(h)
        await h.client.commit("c1", h.deadline(), checkpoint_dir, asynchronous=True)
        await wait_thread_event(storage.reached)
        await h.client.resume("c1", h.deadline())
        await prepared(h, "c2")
        second_dir = str(tmp_path / "second")
        deadline = h.deadline(10)
        call = asyncio.ensure_future(h.client.commit("c2", deadline, second_dir, asynchronous=True))
        await asyncio.sleep(0.2)
        assert not call.done() and h.participant.export_calls == 1
        h.clock.set(deadline + 1)
        await refused(call, "CHECKPOINT_DEADLINE_EXCEEDED")
        storage.release.set()
        assert (await h.client.await_part("c1", h.deadline())).state == (
            pb.PART_WRITE_STATE_DURABLE
        )
        retry = await h.client.commit("c2", h.deadline(), second_dir, asynchronous=True)
        assert retry.snapshot_only and h.participant.export_calls == 2
        done = await h.client.await_part("c2", h.deadline())
        assert done.state == pb.PART_WRITE_STATE_DURABLE
    finally:
        storage.release.set()
        await stop_harness(h)


async def test_a_failed_background_write_is_typed_and_publishes_nothing(
    checkpoint_dir: str,
) -> None:
    failures = [OSError(errno.EIO, "input/output error")]

    def failing_disk(step: str) -> None:
        if step == "after_fsync" and failures:
            raise failures.pop()

    h = await start_harness(storage=LocalStorage(crash_hook=failing_disk))
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await prepared(h)
        reply = await h.client.commit("c1", h.deadline(), checkpoint_dir, asynchronous=True)
        assert reply.snapshot_only
        await h.client.resume("c1", h.deadline())
        failed = await h.client.await_part("c1", h.deadline())
        assert failed.state == pb.PART_WRITE_STATE_FAILED
        assert failed.failure_reason == "STORAGE_FAILED" and failed.failure_message
        assert not (part_dir(checkpoint_dir) / "manifest.json").exists()
        # The participant goes on serving, and the next checkpoint goes ahead.
        h.participant.seed(EpisodeId("r2"), {"n": 2})
        await prepared(h, "c2")
        second = await h.client.commit("c2", h.deadline(), checkpoint_dir + "-2")
        assert second.manifest.record_count == 2
    finally:
        await stop_harness(h)


async def test_a_controller_that_dies_after_the_snapshot_leaves_a_write_that_still_ends(
    checkpoint_dir: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """No Resume and no AwaitPart ever come: the lease reopens the participant, the write
    still publishes its part (which no fleet manifest names), and the next checkpoint goes
    ahead."""
    storage = GatedStorage("before_record")
    h = await start_harness(storage=storage)
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await prepared(h)
        await h.client.commit("c1", h.deadline(10), checkpoint_dir, asynchronous=True)
        await wait_thread_event(storage.reached)
        expires = (await h.client.get_status()).lease_expires_at.ToSeconds()
        h.clock.set(expires + 1)
        await h.until(lambda: h.control.state == "IDLE")
        assert (await h.client.get_status()).admission_open
        storage.release.set()
        await wait_thread_event(storage.finished)
        assert (part_dir(checkpoint_dir) / "manifest.json").exists()
        assert (await h.client.await_part("c1")).state == pb.PART_WRITE_STATE_DURABLE
        await prepared(h, "c2")
        second = str(tmp_path / "second")
        reply = await h.client.commit("c2", h.deadline(), second, asynchronous=True)
        assert reply.snapshot_only
        assert (await h.client.await_part("c2", h.deadline())).state == (
            pb.PART_WRITE_STATE_DURABLE
        )
    finally:
        storage.release.set()
        await stop_harness(h)
